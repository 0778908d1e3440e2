"""One trainer owns a run (issue 26): the device, the process group and the prepared data are set up in one place
(`asyncpipe/runtime/setup.py`, one call from `asyncpipe/trainer.py`), the validation set is built once and handed to the engine, and a data mistake seen by
rank 0 of a multi-process run is still one line and exit 2."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import asyncpipe, truncated_dataset

PACKAGE = Path(__file__).resolve().parents[1] / "asyncpipe"
SET_UP = {"pick_device", "init_process_group", "init_deepspeed_comm", "ensure_prepared"}


PREPARE_COMMAND = {("asyncpipe.data.dataset", "prepare")}


def _calls(package: Path = PACKAGE) -> dict[str, set[str]]:
    """name -> the package's modules that call it (a wrapper calling the library function it is named after,
    such as `dist.init_process_group` calling torch's, does not count; nor does `asyncpipe data prepare`'s own
    function, `data.dataset.prepare`, building a streamed corpus ahead of any run)."""
    found: dict[str, set[str]] = {name: set() for name in SET_UP}
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        wrappers = {f: {id(n) for n in ast.walk(f)} for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        commands = {id(n) for f in tree.body if (module, getattr(f, "name", "")) in PREPARE_COMMAND for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            inside_own_wrapper = any(f.name == name and id(node) in ids for f, ids in wrappers.items())
            if name in SET_UP and not inside_own_wrapper and id(node) not in commands:
                found[name].add(module)
    return found


def test_device_process_group_and_data_are_set_up_by_the_trainer_only() -> None:
    calls = _calls()
    assert calls == {name: {"asyncpipe.runtime.setup"} for name in SET_UP}, calls
    # ... in one call the trainer makes (`runtime.setup.build_setup`), its one trip into the set-up
    trainer = (PACKAGE / "trainer.py").read_text()
    assert trainer.count("build_setup(") == 1
    assert not any(f"{name}(" in trainer for name in ("pick_device", "set_deterministic", "vocab_size_for",
                                                         "init_process_group", "_join_process_group"))


def test_engines_and_runtime_import_neither_the_trainer_nor_the_session() -> None:
    """The runtime docstring's promise: engines talk to the trainer through `runtime.protocol` only."""
    from test_imports import import_graph

    edges, _ = import_graph()
    owners = {"asyncpipe.trainer", "asyncpipe.run", "asyncpipe.rank"}
    below = ("asyncpipe.engines", "asyncpipe.runtime")  # the simulator and engines.pipeline
    wrong = [(m, t) for m, ts in edges.items() if m.startswith(below) for t in ts
             if t in owners or t.startswith("asyncpipe.session")]  # fmt: skip
    assert wrong == []
    assert any(t == "asyncpipe.runtime.protocol" for t in edges["asyncpipe.engines.pipeline.adapter"])


def test_the_trainer_builds_the_validation_set_once_and_the_engine_evaluates_it(monkeypatch) -> None:
    from asyncpipe.config import compose
    from asyncpipe.data import MicroBatches
    from asyncpipe.trainer import Trainer

    cfg = compose(["model=tiny", "device=cpu", "precision=fp32", "train.steps=2", "train.eval_batches=3",
                   "train.micro_batch_size=2", "train.seq_len=16"])  # fmt: skip
    trainer = Trainer(cfg)
    assert len(trainer.val_batches) == 3
    read, val_reads = MicroBatches.get, []

    def counting(self, i):
        if self.split == "val":
            val_reads.append(i)
        return read(self, i)

    monkeypatch.setattr(MicroBatches, "get", counting)
    first = trainer.evaluate()
    trainer.engine.train_step()
    assert trainer.evaluate() != first and val_reads == []  # new weights, the same batches, never read again


def test_the_pipeline_keeps_its_per_replica_share_of_the_validation_set() -> None:
    from asyncpipe.engines.pipeline.adapter import val_share

    assert [val_share(4, 2, r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert val_share(3, 2, 1) == [0, 1, 2]  # unequal shares would bias the mean: every replica does all


@pytest.mark.timeout(240)
def test_a_bad_dataset_under_two_replicas_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Rank 0 prepares the data, the other rank waits; rank 0's user error reaches every rank (no hang, no
    traceback), and the launcher prints it once."""
    env = truncated_dataset(tmp_path / "data")
    run = tmp_path / "run"
    proc = asyncpipe("train", "pipeline.data_parallel=2", "train.steps=2", f"run.dir={run}", env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-800:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.bin" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not run.exists()
