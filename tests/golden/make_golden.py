"""Pin the first 20 steps' train losses and the step-20 val loss of a few configs (issue 26: no behaviour change).

    OMP_NUM_THREADS=1 python tests/golden/make_golden.py        # rewrites tests/golden/losses.json

`tests/test_golden.py` reruns the same configs and compares them with the file. Every config names its lr (and
Muon's aux lr) explicitly, so a change of the default lrs (issue 27's tuned table) does not move these numbers:
only a change of what a config computes does. Simulator configs run in this process on one thread; pipeline
configs run through the local launcher (one thread per rank), as `tests/test_pipe_parity.py` does.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "losses.json"
STEPS = 20
COMMON = [
    "precision=fp32", "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=4", "train.seq_len=32",
    "train.micro_batches=2", f"train.eval_every={STEPS}", "train.eval_batches=4", "train.warmup_frac=0.2",
    "pipeline.threads=1", "run.dir=unused",
]  # fmt: skip
ADAMW = ["optimizer.lr=1e-3"]
MUON = ["optimizer.lr=0.02", "optimizer.aux_lr=3e-3"]
CONFIGS: dict[str, list[str]] = {
    "sim_adamw_d0": ["optimizer=adamw", "delay=0", *ADAMW],
    "sim_adamw_d1": ["optimizer=adamw", "delay=1", *ADAMW],
    "sim_adamw_ef_d1": ["optimizer=adamw_ef", "delay=1", *ADAMW],
    "sim_adamw_ef_override_d1": ["optimizer=adamw", "optimizer.ef.enabled=true", "delay=1", *ADAMW],
    "sim_muon_ef_d1": ["optimizer=muon_ef", "delay=1", *MUON],
    "sim_soap_d1": ["optimizer=soap", "delay=1", "optimizer.lr=3e-3"],
    "sim_ef_adaptive_d1": ["optimizer=adamw", "compensation=ef_adaptive", "delay=1", *ADAMW],
    "sim_weight_prediction_d1": ["optimizer=adamw", "compensation=weight_prediction", "delay=1", *ADAMW],
    "sim_moe_tiny_muon_d1": ["model=moe_tiny", "optimizer=muon", "delay=1", *MUON],
    "pipe_adamw_d0": ["engine=pipeline", "optimizer=adamw", "delay=0", *ADAMW],
    "pipe_muon_ef_d1": ["engine=pipeline", "optimizer=muon_ef", "delay=1", *MUON],
}


def cpu_model() -> str:
    """The CPU kind (floating-point results are bit-reproducible on one kind, not across kinds)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compose(name: str):
    from asyncpipe.config import compose as compose_config

    return compose_config(COMMON + CONFIGS[name])


def run_simulated(name: str) -> dict:
    import torch

    from asyncpipe.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(compose(name))
        losses = [trainer.engine.train_step().train_loss for _ in range(STEPS)]
        return {"train_loss": losses, "val_loss": trainer.evaluate()}
    finally:
        torch.set_num_threads(threads)


def run_pipelined(names: list[str]) -> dict[str, dict]:
    from asyncpipe.spawn import Job, launch

    results = launch([Job(compose(n), None, show_progress=False) for n in names], timeout_s=300)
    out = {}
    for name, result in zip(names, results):
        hist = result["history"]
        assert [h["step"] for h in hist] == list(range(1, STEPS + 1)), name
        out[name] = {"train_loss": [h["train_loss"] for h in hist], "val_loss": result["final_val_loss"]}
    return out


def run(names: list[str]) -> dict[str, dict]:
    """Fresh losses of the named configs."""
    out = {n: run_simulated(n) for n in names if not n.startswith("pipe_")}
    piped = [n for n in names if n.startswith("pipe_")]
    if piped:
        out.update(run_pipelined(piped))
    return out


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    data = {"cpu_model": cpu_model(), "steps": STEPS, "common": COMMON, "configs": CONFIGS,
            "losses": run(list(CONFIGS))}  # fmt: skip
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN} ({len(CONFIGS)} configs on {data['cpu_model']})")


if __name__ == "__main__":
    main()
