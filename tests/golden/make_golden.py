"""Pin the first 20 steps' train losses and the step-20 val loss of a few configs (issue 26: no behaviour change).

    OMP_NUM_THREADS=1 python tests/golden/make_golden.py              # rewrites tests/golden/losses.json
    OMP_NUM_THREADS=1 python tests/golden/make_golden.py --this-cpu   # pins this CPU kind's own bits beside it
    OMP_NUM_THREADS=1 python tests/golden/make_golden.py --add        # pins configs the file lacks, keeps the rest

`losses.json` is the reference. Floating-point results are bit-reproducible on one CPU kind only (the vector
units sum in another order elsewhere), so `--this-cpu` writes `losses-<kind>.json` for the CPU kind it runs on,
and only after checking that its fresh losses agree with the reference within `other_cpu_rtol`: it can add a
machine's exact bits, never re-pin a change of behaviour.

`tests/test_golden.py` reruns the same configs and compares them with the file. Every config names its lr (and
Muon's aux lr) explicitly, so a change of the default lrs (issue 27's tuned table) does not move these numbers:
only a change of what a config computes does. Simulator configs run in this process on one thread; pipeline
configs run through the local launcher (one thread per rank), as `tests/test_pipe_parity.py` does.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "losses.json"
SAME_CPU_RTOL = 1e-6  # the same CPU kind: one thread, fp32, deterministic
OTHER_CPU_RTOL = 1e-3  # another kind: see tests/test_golden.py for the measured drift this allows
# SOAP's eigenbases amplify the last-bit differences: 4.5e-3 by step 17 on an AVX2-only EPYC against the reference,
# while its nearest other config is 8.2e-2 away. Muon, MoE and AdamW drift <= 1.7e-4 there.
OTHER_CPU_RTOL_OF = {"sim_soap_d1": 2e-2}
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
    # Added before the schedules became declared components (issue 38): every schedule and method the
    # refactor touches, pinned first (written with --add on the CPU kind named in `added`).
    "sim_adamw_d2": ["optimizer=adamw", "delay=2", *ADAMW],
    "sim_ef_d1": ["optimizer=adamw", "compensation=ef", "delay=1", *ADAMW],
    # dc's default lam (2.0) moves the losses 3e-5 from sim_adamw_d1: too close to tell apart on another CPU kind
    "sim_dc_d1": ["optimizer=adamw", "compensation=dc", "compensation.dc.lam=500", "delay=1", *ADAMW],
    "sim_update_averaging_d1": ["optimizer=muon", "compensation=update_averaging", "delay=1", *MUON],  # with
    # adamw it lands within 2.4e-2 of sim_soap_d1, inside SOAP's cross-kind tolerance
    "sim_basis_rotation_d1": ["optimizer=adamw", "compensation=basis_rotation", "compensation.rotation.every=4",
                              "delay=1", *ADAMW],
    "sim_pipedream_p4": ["optimizer=adamw", "delay_profile=pipedream", "delay=1", "pipeline.stages=4", *ADAMW],
    "sim_stage_lr_pipedream_p4": ["optimizer=adamw", "compensation=stage_lr", "compensation.stage_lr.anneal_frac=0",
                                  "delay_profile=pipedream", "delay=1", "pipeline.stages=4", *ADAMW],
    "pipe_adamw_d1": ["engine=pipeline", "optimizer=adamw", "delay=1", *ADAMW],
    # PACI (issue 38): its per-stage, per-micro-batch staleness in the simulator and on the pipeline engine; pinned
    # as `paci` when that was the recompute recipe, now `paci-recompute` (same bits)
    "sim_paci_recompute_p4": ["optimizer=adamw", "pipeline.schedule=paci-recompute", "delay=1", "pipeline.clip=stage",
                              "pipeline.stages=4", "train.micro_batches=4", *ADAMW],
    "pipe_paci_recompute_p2": ["engine=pipeline", "optimizer=adamw", "pipeline.schedule=paci-recompute", "delay=1",
                               "pipeline.clip=stage", *ADAMW],
    "pipe_dualpipev_d0": ["engine=pipeline", "pipeline.schedule=dualpipev", "optimizer=adamw", "delay=0",
                          "train.micro_batches=4", *ADAMW],
    # PACI's in-place recipe (revision 2 of `paci`): a straddler back-propagates through its own graph
    # (at lr 1e-3 the two recipes end 2e-4 (P = 2) and 7e-4 (P = 4) apart, inside the other-CPU tolerance: 4e-3
    # moves the weights more between a straddler's forward and its backward)
    "sim_paci_p4": ["optimizer=adamw", "pipeline.schedule=paci", "delay=1", "pipeline.clip=stage", "pipeline.stages=4",
                    "train.micro_batches=4", "optimizer.lr=4e-3"],
    "pipe_paci_p2": ["engine=pipeline", "optimizer=adamw", "pipeline.schedule=paci", "delay=1", "pipeline.clip=stage",
                     "optimizer.lr=4e-3"],
}


def other_cpu_rtol(name: str) -> float:
    """How far a config may drift from the reference on another CPU kind over the pinned steps."""
    return OTHER_CPU_RTOL_OF.get(name, OTHER_CPU_RTOL)


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_kind() -> str:
    """The CPU kind results are bit-reproducible on: the model name and the vector extensions the kernels dispatch
    on (two 'AMD EPYC' machines, one with AVX-512 and one without, differ from step 4 on SOAP)."""
    model, flags = _cpuinfo()
    simd = sorted(f for f in flags if re.match(r"(avx|fma|amx|f16c|sse4)", f))
    widest = "avx512" if "avx512f" in simd else "avx2" if "avx2" in simd else "no-avx2"
    digest = hashlib.sha1(" ".join(simd).encode()).hexdigest()[:8]
    return f"{model}, {widest} {digest}"


def kind_file(kind: str) -> Path:
    """Where a CPU kind's own pinned bits live."""
    return HERE / f"losses-{re.sub(r'[^A-Za-z0-9]+', '-', kind).strip('-').lower()}.json"


def agree(fresh: list[float], pinned: list[float], rtol: float) -> bool:
    return len(fresh) == len(pinned) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(fresh, pinned))


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


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    kind = cpu_kind()
    if "--add" in argv:  # new configs into the reference, the pinned ones untouched (their bits stay the reference's)
        data = json.loads(GOLDEN.read_text(encoding="utf-8"))
        new = [n for n in CONFIGS if n not in data["losses"]]
        data["losses"].update(run(new))
        data["configs"] = CONFIGS
        data.setdefault("added", {}).update({n: kind for n in new})
        GOLDEN.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"added {', '.join(new) or 'nothing'} to {GOLDEN} on {kind}")
        return
    losses = run(list(CONFIGS))
    if "--this-cpu" in argv:
        reference = json.loads(GOLDEN.read_text(encoding="utf-8"))["losses"]
        off = [n for n in CONFIGS if not agree(losses[n]["train_loss"] + [losses[n]["val_loss"]],
                                                  reference[n]["train_loss"] + [reference[n]["val_loss"]],
                                                  other_cpu_rtol(n))]  # fmt: skip
        if off:
            sys.exit(f"not pinned: {', '.join(off)} differ from {GOLDEN.name} by more than other_cpu_rtol "
                     "(a change of behaviour, not of CPU kind)")
        path, data = kind_file(kind), {"cpu_kind": kind, "losses": losses}
    else:
        path = GOLDEN
        data = {"cpu_kind": kind, "steps": STEPS, "common": COMMON, "configs": CONFIGS, "losses": losses}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(CONFIGS)} configs on {kind})")


if __name__ == "__main__":
    main(sys.argv[1:])
