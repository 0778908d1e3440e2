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
    """The GPU path cannot run here; its dry run (tiny, CPU, the pipeline on 2 CPU processes) must pass, so a
    GPU session is not spent finding a bug in the script. Its compiled runs use the aot_eager backend (the
    compiled code paths without CPU kernel compiling: 72 -> 34 s here); test_compile.py trains with inductor."""
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--steps", "6",
                           "--micro-batch-size", "2", "--seq-len", "64"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "tiny bf16 simulator" in out and "tiny CPU vs CUDA" in out and "ok" in out
    assert "tiny bf16 simulator, compiled (aot_eager)" in out
    assert "pipeline engine, 2 CPU processes, 2BW tiny 20 steps" in out and "gpu-check dry run: ok" in out


def test_flops_per_token_and_peak_table() -> None:
    gpu_check = _gpu_check()
    flops_per_token, peak_tflops = gpu_check.flops_per_token, gpu_check.peak_tflops
    m = compose(["model=tiny"]).model  # d 64, kv 32, d_ff 176, 4 blocks
    per_block = 64 * 64 * 2 + 2 * 32 * 64 + 3 * 64 * 176
    assert flops_per_token(m, 256, 128) == 6 * (4 * per_block + 256 * 64) + 12 * 4 * 64 * 128
    moe = compose(["model=moe_tiny"]).model  # 4 experts of width 96, top-2, router 4 x 64
    per_block = 64 * 64 * 2 + 2 * 32 * 64 + 4 * 64 + 2 * 3 * 64 * 96
    assert flops_per_token(moe, 256, 128) == 6 * (4 * per_block + 256 * 64) + 12 * 4 * 64 * 128
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops("Some New Card") is None
