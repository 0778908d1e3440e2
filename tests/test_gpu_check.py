"""The prepared GPU check: on a machine without CUDA it fails with one clear line; its FLOPs formula by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncpipe.config import compose

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _gpu_check():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    return gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: `make gpu-check` runs for real")
def test_fails_clearly_without_a_gpu(capsys: pytest.CaptureFixture) -> None:
    # In this process: the script's exit status is main()'s (sys.exit(main())), and a fresh interpreter would only
    # add its seconds of torch import.
    assert _gpu_check().main([]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("gpu-check: FAIL: no CUDA device")


@pytest.mark.slow
def test_dry_run_on_the_cpu_exercises_every_part() -> None:
    """The GPU path cannot run here; its dry run (tiny, CPU, the 2-GPU parts on 2 CPU processes) must pass, so a
    GPU session is not spent finding a bug in the script. Its compiled runs use the aot_eager backend (the
    compiled code paths without CPU kernel compiling); test_compile.py trains with inductor."""
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--steps", "6",
                           "--micro-batch-size", "2", "--seq-len", "64", "--pipe-steps", "6"], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "tiny bf16 simulator, eager" in out and "tiny bf16 simulator, compiled (aot_eager)" in out
    assert "tiny CPU vs CUDA" in out
    for part in ("2bw fp32 adamw eager, 2 CPU processes", "2bw fp32 adamw compiled, 2 CPU processes",
                 "2bw fp32 adamw deterministic, 2 CPU processes", "1f1b fp32 adamw, 2 CPU processes",
                 "dualpipev fp32 adamw, 2 CPU processes", "2bw fp32 moe_tiny muon, 2 CPU processes",
                 "2bw bf16 muon+ef, 2 CPU processes",
                 "simulate data_parallel=2 fp32, 2 CPU processes"):  # fmt: skip
        assert f"{part}, 6 steps" in out and "ok" in out.split(part)[1].splitlines()[0], part
    assert "kill and resume, 2BW pipeline on 2 CPU processes" in out and "bit for bit the uninterrupted losses, ok" in out
    assert "SLURM task environment, 1 node x 2 tasks on CPU: exit codes [0, 0]" in out
    assert "gpu-check dry run: ok" in out and "FAIL" not in out


def test_one_gpu_ends_incomplete_never_ok(monkeypatch, tmp_path, capsys) -> None:
    """With one GPU the 2-GPU parts cannot run: the check names them and exits 3 with "incomplete", not "ok"."""
    gpu_check = _gpu_check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "train_135m", lambda args, log: {"stub": True})  # the 1-GPU parts passed
    monkeypatch.setattr(gpu_check, "cpu_vs_cuda", lambda log, dry_run=False: {"stub": True})
    monkeypatch.setattr(gpu_check, "OUT", tmp_path / "gpu-check.json")
    assert gpu_check.main([]) == gpu_check.EXIT_INCOMPLETE == 3
    out = capsys.readouterr().out
    assert "kill and resume: not run (1 GPU visible; it needs 2)" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("gpu-check: incomplete") and "SLURM task environment (1 GPU visible" in last
    assert "gpu-check: ok" not in out


def test_flops_per_token_and_peak_table() -> None:
    gpu_check = _gpu_check()
    flops_per_token, peak_tflops = gpu_check.flops_per_token, gpu_check.peak_tflops
    m = compose(["model=tiny"]).model  # d 64, kv 32, d_ff 176, 4 blocks
    per_block = 64 * 64 * 2 + 2 * 32 * 64 + 3 * 64 * 176
    assert flops_per_token(m, 256, 128) == 6 * (4 * per_block + 256 * 64) + 12 * 4 * 64 * 128
    moe = compose(["model=moe_tiny"]).model  # 4 experts of width 96, top-2, router 4 x 64
    per_block = 64 * 64 * 2 + 2 * 32 * 64 + 4 * 64 + 2 * 3 * 64 * 96
    assert flops_per_token(moe, 256, 128) == 6 * (4 * per_block + 256 * 64) + 12 * 4 * 64 * 128
    assert flops_per_token(moe, 256, 128, causal=True) == 6 * (4 * per_block + 256 * 64) + 6 * 4 * 64 * 128
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops("Some New Card") is None
