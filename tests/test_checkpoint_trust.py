"""A checkpoint is untrusted input: a hostile part can fail to load, never run code; a foreign one is refused from
its marker before any part is deserialised; a damaged marker is one line, not a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncpipe.errors import UserError
from asyncpipe.runtime import checkpoint
from helpers import asyncpipe

RUN = ["optimizer=adamw", "delay=1", "train.steps=8", "train.eval_every=4", "checkpoint.every=4"]


class _Payload:
    """Unpickling this calls Path.touch on `target`: what an attacker's checkpoint would do."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("trust") / "run"
    proc = asyncpipe("train", *RUN, f"run.dir={run}")
    assert proc.returncode == 0, proc.stderr
    return run


def _interrupted_copy(finished: Path, dest: Path) -> Path:
    """The finished run with its summary removed and its last checkpoint dropped, as a killed run leaves it."""
    shutil.copytree(finished, dest)
    (dest / "summary.json").unlink()
    ckpts = sorted((dest / "checkpoints").iterdir())
    for extra in ckpts[1:]:
        shutil.rmtree(extra)
    return ckpts[0].parent / ckpts[0].name


def _plant(step: Path, fingerprint: dict, marker: Path) -> None:
    blob = {"format": checkpoint.FORMAT, "fingerprint": fingerprint, "rank": 0, "world": 1,
            "state": {"x": _Payload(marker)}}
    torch.save(blob, step / "rank0.pt")


def test_malicious_part_with_matching_fingerprint_never_executes(finished: Path, tmp_path: Path) -> None:
    run = tmp_path / "hostile"
    step = _interrupted_copy(finished, run)
    fingerprint = json.loads((step / checkpoint.MARKER).read_text())["fingerprint"]
    marker = tmp_path / "pwned"
    _plant(step, fingerprint, marker)
    proc = asyncpipe("train", *RUN, f"run.dir={run}", "resume=true")
    assert not marker.exists(), "unpickling the checkpoint ran the attacker's code"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "cannot be read safely" in err


def test_malicious_part_with_foreign_fingerprint_is_refused_before_reading(tmp_path: Path) -> None:
    step = tmp_path / "step_00000004"
    step.mkdir()
    ours = {"model": "tiny", "seed": 0}
    (step / checkpoint.MARKER).write_text(json.dumps({"format": checkpoint.FORMAT, "step": 4, "world": 1,
                                                       "fingerprint": {"model": "tiny", "seed": 1}}))
    marker = tmp_path / "pwned"
    _plant(step, {"model": "tiny", "seed": 1}, marker)
    with pytest.raises(UserError, match="belongs to a different run"):
        checkpoint.load(step, ours)
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"\xff\xfe not json", b"[1, 2]", b'{"format": "something-else"}', b""])
def test_damaged_marker_is_one_line(tmp_path: Path, content: bytes) -> None:
    step = tmp_path / "step_00000004"
    step.mkdir()
    (step / checkpoint.MARKER).write_bytes(content)
    with pytest.raises(UserError, match="cannot be read"):
        checkpoint.load(step, {"model": "tiny"})


def test_marker_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    step = tmp_path / "step_00000004"
    (step / checkpoint.MARKER).mkdir(parents=True)
    with pytest.raises(UserError, match="not a regular file"):
        checkpoint.read_marker(step)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def _truncate_part(step: Path) -> None:
    part = step / "rank0.pt"
    part.write_bytes(part.read_bytes()[:1000])


def _damage_marker(step: Path) -> None:
    (step / checkpoint.MARKER).write_bytes(b"\xff\xfe not json")


@pytest.mark.parametrize("damage", [_truncate_part, _damage_marker], ids=["truncated part", "damaged marker"])
def test_a_refused_resume_changes_nothing_in_the_run_dir(finished: Path, tmp_path: Path, damage) -> None:
    """The only checkpoint damaged, no earlier one: resume=true is refused in one line, and provenance.json gains no
    `resumed` entry (nor train.log a line, nor config.yaml a byte) for a resume that never happened."""
    run = tmp_path / "damaged"
    damage(_interrupted_copy(finished, run))
    before = _tree(run)
    proc = asyncpipe("train", *RUN, f"run.dir={run}", "resume=true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    after = _tree(run)
    assert "resumed" not in json.loads(after["provenance.json"])
    assert after == before, sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
