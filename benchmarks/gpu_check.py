"""The prepared GPU check (`make gpu-check`): on a machine with CUDA, in a few minutes (not yet timed on a GPU),

1. trains `135m` in the simulator with bf16 autocast, eager and compiled (`train.compile`), and reports tokens/s,
   MFU, the peak memory of each mode (the peak counter reset between them) and the compiled speed-up (compile time
   counted apart: the timed steps come after the warm-up);
2. checks that `tiny` trains to the same losses on CPU and CUDA for 5 steps (fp32, AdamW; relative tolerance
   LOSS_RTOL per step: different kernels sum in different orders, nothing else may differ);
3. with two GPUs (`benchmarks/gpu_check_multi.py`): the pipeline engine on 2 GPUs over NCCL against the simulator
   (2BW fp32 eager and compiled, 1F1B and DualPipeV fp32, 2BW bf16 with Muon + EF, 2BW moe_tiny with Muon), the
   simulator with data_parallel=2, a kill-and-resume of the pipeline (bit for bit with train.deterministic=true),
   and one launch in an emulated SLURM task environment (2 tasks on one node, SLURM's CUDA_VISIBLE_DEVICES).

It exits 1 with one line on a machine without a CUDA device, 1 on a failed part, and 3 with "gpu-check: incomplete"
naming the parts it could not run (one GPU: every part of 3). Results also go to benchmarks/results/gpu-check.json.

MFU = model FLOPs per token x tokens/s / the card's dense bf16 peak (PEAK_TFLOPS, by device name; --peak-tflops
overrides). Model FLOPs per token (PaLM's convention, training = forward + backward = 3 x forward):
    6 * N_matmul + 12 * n_layer * d_model * seq_len
with N_matmul the weights a token multiplies by (attention and MLP/expert-active matrices of every block, plus the
output head; not the embedding lookup), and the second term the attention scores and weighted values counted
over the full (not causal) T x T matrix. A causal kernel computes about half of that matrix, so the check also
prints the MFU with the attention term halved ("causal"); the first is the convention, the second the work done.

    .venv/bin/python benchmarks/gpu_check.py [--modes eager,compiled] [--steps 30] [--micro-batch-size 16] [--seq-len 1024]
    .venv/bin/python benchmarks/gpu_check.py --dry-run --steps 6 --micro-batch-size 2 --seq-len 64 --pipe-steps 6   # on a CPU

A dry run runs every part on the CPU (tiny in place of 135m, 2 CPU processes in place of 2 GPUs) and measures
nothing. It compiles with `train.compile_backend=aot_eager` unless --compile-backend says otherwise: the compiled
code paths run (dynamo and AOTAutograd trace the same graphs) without tens of seconds of CPU kernel compiling that
say nothing about the GPU; tests/test_compile.py checks inductor's compiled training on the CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from asyncpipe.config.validate import COMPILE_BACKENDS

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "gpu-check.json"
LOSS_RTOL = 2e-3  # CPU vs CUDA, fp32, per step of the first 5
EXIT_INCOMPLETE = 3  # every part that ran passed, but some could not run here
# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets; first match wins.
PEAK_TFLOPS = [
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("RTX 4090", 165.0),
    ("A6000", 155.0),
]  # fmt: skip


def peak_tflops(device_name: str) -> Optional[float]:
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def flops_per_token(model: Any, vocab: int, seq_len: int, causal: bool = False) -> float:
    """6 N_matmul + 12 L d T (see the module docstring); ``causal``: the attention term halved (the work a causal
    kernel does)."""
    from asyncpipe.plan import layer_shapes

    norms = 2 * model.d_model
    blocks = sum(s.active - norms for s in layer_shapes(model, vocab) if s.kind == "block")  # MoE: router + top-k
    n_matmul = blocks + vocab * model.d_model  # head (tied or not, it is a matmul)
    return 6.0 * n_matmul + (6.0 if causal else 12.0) * model.n_layer * model.d_model * seq_len


def _cfg(overrides: list[str], backend: str = "inductor") -> Any:
    from asyncpipe.config import compose

    return compose(["train.eval_every=100000", "run.dir=unused", f"train.compile_backend={backend}"] + overrides)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _throughput(args: argparse.Namespace, log: Any, compiled: bool) -> dict:
    import torch

    from asyncpipe.trainer import Trainer

    dev, model = ("cpu", "tiny") if args.dry_run else ("cuda", "135m")
    cfg = _cfg([f"model={model}", f"device={dev}", "precision=bf16", "optimizer=adamw", f"train.steps={args.steps}",
                f"train.micro_batch_size={args.micro_batch_size}", f"train.seq_len={args.seq_len}",
                "train.micro_batches=1", f"train.compile={compiled}"], args.compile_backend)  # fmt: skip
    gc.collect()  # the previous mode's model and optimizer are gone before this one's peak is measured
    trainer = Trainer(cfg).engine
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()  # this mode's peak only (eager ran first in this process)
    warm = min(5, args.steps // 3)  # the first step compiles (train.compile=true): never timed
    losses = []
    _sync(dev)
    began = time.perf_counter()
    for _ in range(warm):
        losses.append(trainer.train_step().train_loss)
    _sync(dev)
    start = time.perf_counter()
    for _ in range(args.steps - warm):
        losses.append(trainer.train_step().train_loss)
    _sync(dev)
    seconds = time.perf_counter() - start
    tokens_per_s = trainer.tokens_per_step * (args.steps - warm) / seconds
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)"
    peak = args.peak_tflops or peak_tflops(name)
    fpt = flops_per_token(cfg.model, trainer.vocab_size, args.seq_len)
    mfu = fpt * tokens_per_s / (peak * 1e12) if peak else None
    causal = flops_per_token(cfg.model, trainer.vocab_size, args.seq_len, causal=True) * tokens_per_s / (peak * 1e12) if peak else None
    out = {"device": name, "peak_tflops": peak, "tokens_per_s": tokens_per_s, "flops_per_token": fpt, "mfu": mfu,
           "mfu_causal_attention": causal, "attention_flops": "full T x T (PaLM); mfu_causal_attention: halved",
           "compile": compiled, "warmup_s": start - began, "micro_batch_size": args.micro_batch_size,
           "seq_len": args.seq_len, "first_loss": losses[0], "last_loss": losses[-1],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None}  # fmt: skip
    mfu_text = (f"MFU {mfu:.1%} of {peak:g} TFLOP/s (attention over the full T x T; causal-half {causal:.1%})"
                if mfu is not None and causal is not None
                else f"MFU unknown ({name} not in the table; --peak-tflops)")  # fmt: skip
    mode = f"compiled ({args.compile_backend})" if compiled else "eager"
    log(f"{model} bf16 simulator, {mode}: {tokens_per_s:,.0f} tokens/s, {mfu_text}; warm-up {warm} steps "
        f"{start - began:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (f"; peak memory {out['peak_mem_gib']:.2f} GiB" if out["peak_mem_gib"] is not None else ""))  # fmt: skip
    if not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
        raise SystemExit(f"FAIL: {model} {mode} did not train (loss not finite or not falling)")
    return out


def train_135m(args: argparse.Namespace, log: Any) -> dict:
    """Throughput per mode of ``--modes``, and compiled over eager when both ran (the same steps, one after the
    other on an otherwise idle GPU)."""
    out = {mode: _throughput(args, log, mode == "compiled") for mode in args.modes}
    if {"eager", "compiled"} <= set(out):
        out["compile_speedup"] = out["compiled"]["tokens_per_s"] / out["eager"]["tokens_per_s"]
        log(f"compiled / eager tokens/s: {out['compile_speedup']:.2f}x")
    return out


def cpu_vs_cuda(log: Any, dry_run: bool = False) -> dict:
    from asyncpipe.trainer import Trainer

    runs = {}
    for device in ("cpu", "cpu" if dry_run else "cuda"):
        trainer = Trainer(_cfg(["model=tiny", f"device={device}", "precision=fp32", "optimizer=adamw",
                                "train.steps=5"])).engine  # fmt: skip
        runs["cuda" if runs else "cpu"] = [trainer.train_step().train_loss for _ in range(5)]
    worst = max(abs(a - b) / abs(a) for a, b in zip(runs["cpu"], runs["cuda"]))
    ok = worst <= LOSS_RTOL
    log(f"tiny CPU vs CUDA, 5 steps fp32: worst relative loss difference {worst:.2e} (tolerance {LOSS_RTOL:g}) "
        f"{'ok' if ok else 'FAIL'}")  # fmt: skip
    if not ok:
        raise SystemExit(f"FAIL: CPU {runs['cpu']} vs CUDA {runs['cuda']}")
    return {"cpu": runs["cpu"], "cuda": runs["cuda"], "worst_rel": worst, "rtol": LOSS_RTOL}


def multi_gpu(args: argparse.Namespace, log: Any) -> tuple[dict, dict[str, str]]:
    """The parts that need two GPUs (`gpu_check_multi`); with fewer, each is named as not run, with the reason."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_check_multi as multi

    parts = ("pipeline parity (2BW fp32 eager/compiled/deterministic, 1F1B, DualPipeV, 2BW bf16 Muon+EF, 2BW MoE, "
             "simulate data_parallel=2)",
             "kill and resume", "SLURM task environment")  # fmt: skip
    gpus = torch.cuda.device_count()
    if not args.dry_run and gpus < 2:
        why = f"{gpus} GPU visible; it needs 2"
        for part in parts:
            log(f"{part}: not run ({why})")
        return {"skipped": why}, dict.fromkeys(parts, why)
    from asyncpipe.runtime.device import visible_gpus

    dev = "cpu" if args.dry_run else "cuda"
    out = {"parity": multi.parity(_cfg, dev, args.pipe_steps, args.modes, args.compile_backend, log)}
    out["kill_and_resume"] = multi.kill_and_resume(dev, args.pipe_steps, out["parity"].pop("_deterministic"), log)
    reference = out["parity"].pop("_reference")
    visible = visible_gpus() or [str(i) for i in range(gpus)]
    out["slurm_env"] = multi.slurm_env(dev, args.pipe_steps, visible, reference, log)
    return out, {}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="The prepared GPU check: throughput/MFU, CPU-vs-CUDA losses, pipeline.")
    ap.add_argument("--steps", type=int, default=30, help="135m optimizer steps (the first 5 are warm-up)")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--modes", type=lambda v: tuple(m for m in v.split(",") if m), default=("eager", "compiled"),
                    help="eager,compiled (default: both; train.compile)")
    ap.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=None,
                    help="train.compile_backend of the compiled runs (default: inductor; aot_eager in a dry run)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 peak, if not in the table")
    ap.add_argument("--pipe-steps", type=int, default=20, help="steps of each multi-GPU part's tiny runs")
    ap.add_argument("--dry-run", action="store_true", help="check this script on the CPU: tiny in place of 135m, "
                    "CPU in place of CUDA (the 2-GPU parts on 2 CPU processes); measures nothing (tests use it)")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.modes or set(args.modes) - {"eager", "compiled"}:
        ap.error(f"--modes {','.join(args.modes)}: give eager, compiled or both")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.dry_run else "inductor")
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print(f"gpu-check: FAIL: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "run it on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)  # fmt: skip
        return 1
    started = time.perf_counter()
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    result = {"throughput": train_135m(args, log), "cpu_vs_cuda": cpu_vs_cuda(log, args.dry_run)}
    result["multi_gpu"], not_run = multi_gpu(args, log)
    result["wall_s"] = time.perf_counter() - started
    result["not_run"] = not_run
    verdict = "ok" if not not_run else "incomplete"
    if args.dry_run:
        log(f"gpu-check dry run: {verdict} in {result['wall_s']:.0f} s (every part ran on the CPU; nothing written)")
        return 0 if not not_run else EXIT_INCOMPLETE
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(OUT)
    if not_run:
        log(f"gpu-check: incomplete in {result['wall_s']:.0f} s: not run: {'; '.join(f'{p} ({w})' for p, w in not_run.items())}; "
            f"every part that ran passed; wrote {OUT}")
        return EXIT_INCOMPLETE
    log(f"gpu-check: ok in {result['wall_s']:.0f} s; wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
