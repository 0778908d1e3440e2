"""No behaviour change (issue 26): fresh runs of the pinned configs reproduce tests/golden/losses.json.

Tolerance. On the CPU kind that wrote a file the runs are deterministic (one thread, fp32), so they must agree
to 1e-6 relative. On another CPU kind the vector units sum in another order: runs agree to ~1e-7 at step 2
and drift after. Measured on an AVX2-only AMD EPYC against the reference: AdamW+EF within 1e-7 over 20 steps,
Muon+EF and MoE+Muon up to 1.7e-4, SOAP (whose eigenbases amplify the last bits) 1.4e-4 at step 4 and 4.5e-3 by
step 17. The cross-kind tolerance is therefore per config (`make_golden.other_cpu_rtol`): 1e-3, SOAP 2e-2. Each
is at least 2x below the smallest difference between that config and any other pinned config that computes
something else (EF vs adaptive EF at delay 1: 4.6e-3 at some step; SOAP vs AdamW at delay 1: 8.2e-2), which
`test_the_loose_tolerance_still_tells_configs_apart` checks, so a real change still fails on any machine.
A CPU kind (`cpu_kind`: model name and vector extensions) with its own file, `losses-<kind>.json` (written by
`make_golden.py --this-cpu`, which refuses bits that differ from the reference by more than
`make_golden.other_cpu_rtol`), is also held to its own bits at 1e-6. Configs added later (`make_golden.py --add`,
which records the CPU kind that wrote them under "added") are absent from older kinds' files: those kinds hold
them to the reference only. Regenerate the reference with
`python tests/golden/make_golden.py` only when a change of results is intended (and say so in the commit).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "golden"


def _maker():
    spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _maker()
SAME_CPU_RTOL = MAKER.SAME_CPU_RTOL
PINNED = json.loads((HERE / "losses.json").read_text(encoding="utf-8"))
KIND = MAKER.cpu_kind()
SAME_KIND = PINNED["cpu_kind"] == KIND
KIND_FILES = sorted(HERE.glob("losses-*.json"))
OWN = MAKER.kind_file(KIND)
OWN_BITS = json.loads(OWN.read_text(encoding="utf-8"))["losses"] if OWN.exists() else None
SIMULATED = [n for n in PINNED["configs"] if not n.startswith("pipe_")]
PIPELINED = [n for n in PINNED["configs"] if n.startswith("pipe_")]


def _same(fresh: dict, pinned: dict, name: str, rtol: float) -> None:
    assert len(fresh["train_loss"]) == len(pinned["train_loss"]) == PINNED["steps"]
    for step, (a, b) in enumerate(zip(fresh["train_loss"], pinned["train_loss"]), start=1):
        assert a == pytest.approx(b, rel=rtol), f"{name}: train loss at step {step}"
    assert fresh["val_loss"] == pytest.approx(pinned["val_loss"], rel=rtol), f"{name}: val loss at step 20"


def _check(fresh: dict, name: str) -> None:
    """The reference (exactly on its own CPU kind, else within `other_cpu_rtol`), and this kind's own bits if pinned."""
    _same(fresh, PINNED["losses"][name], name, SAME_CPU_RTOL if SAME_KIND else MAKER.other_cpu_rtol(name))
    if OWN_BITS is not None and name in OWN_BITS:
        _same(fresh, OWN_BITS[name], f"{name} ({OWN.name})", SAME_CPU_RTOL)


def test_the_file_pins_what_the_maker_runs():
    assert PINNED["configs"] == MAKER.CONFIGS and PINNED["common"] == MAKER.COMMON and PINNED["steps"] == MAKER.STEPS


def test_the_loose_tolerance_still_tells_configs_apart():
    runs = PINNED["losses"]
    gaps = []
    for i, a in enumerate(runs):
        for b in list(runs)[i + 1 :]:
            gap = max(abs(x - y) / y for x, y in zip(runs[a]["train_loss"], runs[b]["train_loss"]))
            if gap > 1e-6:  # pairs that compute the same thing (simulator vs pipeline, adamw_ef vs its override)
                gaps.append((gap / max(MAKER.other_cpu_rtol(a), MAKER.other_cpu_rtol(b)), a, b))
    assert gaps and min(gaps)[0] > 2, min(gaps)
    assert all(math.isfinite(x) for v in runs.values() for x in v["train_loss"])


@pytest.mark.parametrize("path", KIND_FILES, ids=[p.name for p in KIND_FILES])
def test_a_cpu_kinds_own_bits_agree_with_the_reference(path):
    """What --this-cpu checks before writing, checked again on the committed file: a kind's bits may differ from the
    reference in the last places, never by a change of behaviour."""
    own = json.loads(path.read_text(encoding="utf-8"))
    assert path == MAKER.kind_file(own["cpu_kind"]) and set(own["losses"]) <= set(PINNED["configs"])
    later = set(PINNED.get("added", {}))
    assert set(PINNED["configs"]) - set(own["losses"]) <= later, "a kind's file lacks a config pinned before it"
    for name, pinned in PINNED["losses"].items():
        if name not in own["losses"]:
            continue
        _same(own["losses"][name], pinned, f"{name} ({path.name})", MAKER.other_cpu_rtol(name))


def test_the_cpu_kind_tells_vector_units_apart(monkeypatch):
    info = {"avx2": ("AMD EPYC", ["fpu", "avx", "avx2", "fma"]), "avx512": ("AMD EPYC", ["avx", "avx2", "avx512f"])}
    kinds = {}
    for label, value in info.items():
        monkeypatch.setattr(MAKER, "_cpuinfo", lambda value=value: value)
        kinds[label] = MAKER.cpu_kind()
    assert kinds["avx2"].startswith("AMD EPYC, avx2 ") and kinds["avx512"].startswith("AMD EPYC, avx512 ")
    assert MAKER.kind_file(kinds["avx2"]) != MAKER.kind_file(kinds["avx512"])


@pytest.mark.parametrize("name", SIMULATED)
def test_simulator_reproduces_the_golden_losses(name):
    _check(MAKER.run([name])[name], name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_reproduces_the_golden_losses():
    fresh = MAKER.run(PIPELINED)
    for name in PIPELINED:
        _check(fresh[name], name)
