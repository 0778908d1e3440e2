"""DualPipeV's one-batch order written out (`asyncpipe.schedules.dualpipev.dualpipev`, torch-free) is DeepSpeed's own
`DualPipeVSchedule` order, op for op on every rank, and its instruction count per rank is DeepSpeed's too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncpipe.errors import UserError
from asyncpipe.schedules.dualpipev import dualpipev, dualpipev_from_deepspeed, dualpipev_instructions

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("P", range(1, 9))
def test_our_dualpipev_is_deepspeeds_order_on_every_rank(P: int) -> None:
    """Every m from 2P (the least DeepSpeed accepts) to 4P + 3, every rank."""
    for m in range(2 * P, 4 * P + 4):
        ours = dualpipev(P, m)
        theirs, counts = dualpipev_from_deepspeed(P, m)
        assert ours.chunk_rank == theirs.chunk_rank
        for r in range(P):
            assert ours.ranks[r] == theirs.ranks[r], (P, m, r)
            assert dualpipev_instructions(P, m, r) == counts[r], (P, m, r)


@pytest.mark.parametrize("P,m", [(1, 1), (2, 3), (4, 7), (8, 15)])
def test_fewer_than_2p_micro_batches_is_one_line(P: int, m: int) -> None:
    with pytest.raises(UserError, match=f"dualpipev needs micro-batches >= 2 x stages \\(got m={m}, P={P}\\)"):
        dualpipev(P, m)


def test_the_dualpipev_ratio_imports_neither_torch_nor_deepspeed() -> None:
    """The report models DualPipeV at depths no bench file measured with this, so it must stay torch-free."""
    code = ("import sys; from asyncpipe.timelines.cost import CostModel, ratio; "
            "m = CostModel('hand', False, forward=[0] + [1] * 16 + [0], backward=[0] + [2] * 16 + [0], "
            "params=[0] + [1] * 16 + [0], tokens_per_micro_batch=1, step_per_param=0.25, overhead_s=0.01); "
            "r = ratio(m, 'dualpipev', '1f1b', 4, 8); assert r > 1, r; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
