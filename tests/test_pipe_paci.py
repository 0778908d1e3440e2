"""PACI (`pipeline.schedule=paci`, `asyncpipe.schedules.paci`, and its recompute recipe `paci-recompute`): its
staleness pattern derived by hand, its stream, what it refuses, the in-place backward's arithmetic, the simulator's
staged run, and parity of the pipeline engine with the simulator at P = 2 and 4 for both recipes.

Parity launches (slow): one per world size, 10 steps of the tiny model in fp32."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError
from asyncpipe.schedules.instructions import BackwardPass, ForwardPass, OptimizerStep, flatten
from asyncpipe.schedules import get

PACI = get("paci")
STEPS = 10
BASE = [
    "precision=fp32", "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=4", "train.seq_len=32",
    "train.eval_every=5", "train.eval_batches=4", "train.warmup_frac=0.2", "pipeline.threads=1", "run.dir=unused",
    "pipeline.schedule=paci", "delay=1", "pipeline.clip=stage", "train.micro_batches=4",
]  # fmt: skip


def _stage_events(P: int, m: int, s: int, batches: int) -> list:
    return [c for c in flatten(PACI.stream(m, P, s, batches, 0, False)) if isinstance(c, (ForwardPass, BackwardPass, OptimizerStep))]


@pytest.mark.parametrize("P,m", [(2, 2), (4, 4), (4, 6)])
def test_versions_are_the_updates_each_pass_follows_in_the_stream(P, m):
    """Replay each stage's own stream: a pass reads W(number of steps before it). That is the declaration."""
    for s in range(P):
        steps = 0
        seen = {}
        for cmd in _stage_events(P, m, s, 4):
            if isinstance(cmd, OptimizerStep):
                steps += 1
            else:
                assert cmd.version == steps, (s, cmd)
                seen.setdefault(cmd.micro_batch, []).append(cmd.version)
        assert {k: tuple(v) for k, v in seen.items()} == {k: PACI.versions(P, m, s, k) for k in range(4 * m)}


def test_straddlers_by_hand():
    # P=4, m=4: stage s has w = 3 - s warm-up forwards, so in every batch after the first its first w
    # micro-batches run forward on W(b-1) and backward on W(b); the last stage never straddles.
    P, m = 4, 4
    for s, w in enumerate([3, 2, 1, 0]):
        straddle = [k for k in range(12) if PACI.straddles(P, m, s, k)]
        assert straddle == [k for b in (1, 2) for k in range(b * m, b * m + w)]
        assert PACI.versions(P, m, s, 4 + w) == (1, 1)
    assert PACI.versions(4, 4, 0, 4) == (0, 1)


def test_one_f_one_b_order_and_at_most_p_minus_s_in_flight():
    P, m = 4, 4
    for s in range(P):
        held, peak, order = 0, 0, []
        for cmd in _stage_events(P, m, s, 3):
            if isinstance(cmd, ForwardPass):
                held += 1
            elif isinstance(cmd, BackwardPass):
                held -= 1
                order.append(cmd.micro_batch)
            peak = max(peak, held)
        assert peak == P - s == PACI.in_flight(P, m, s)[0]
        assert order == sorted(order)  # the oldest in flight first
    assert PACI.weight_versions(P, 0) == 1


@pytest.mark.parametrize("extra,match", [
    (["pipeline.clip=global"], "pipeline.clip=stage"),
    (["compensation=dc"], "not defined under pipeline.schedule=paci"),
    (["train.micro_batches=2", "pipeline.stages=4"], "micro_batches >= pipeline.stages"),
    (["delay=0"], "use delay=1"),
    (["delay_profile=pipedream"], "drop one of them"),
])  # fmt: skip
def test_what_paci_refuses_is_one_line(extra, match):
    with pytest.raises(ConfigError, match=match):
        compose(BASE + extra)


def test_clipping_off_needs_no_clip_mode():
    assert compose(BASE + ["pipeline.clip=global", "train.grad_clip=0"]).pipeline.schedule == "paci"


def _simulate(cfg, steps: int = STEPS):
    import torch

    from asyncpipe.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(OmegaConf.merge(cfg, {"engine": "simulate"}))
        results = [trainer.engine.train_step() for _ in range(steps)]
        return trainer, results, trainer.evaluate()
    finally:
        torch.set_num_threads(threads)


def test_the_in_place_backward_reads_forward_inputs_and_current_weights():
    """`keep_saved_tensors` by hand on y = tanh(x W^T + c): after W -> 2W and c -> c + 1 in place, the weight
    gradient is g^T x with the forward's g = 1 - y^2 (saved activations), the input gradient g (2W) (the weights
    as they are now); without it stock torch refuses the backward."""
    import torch

    from asyncpipe.runtime.saved import keep_saved_tensors

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with keep_saved_tensors():
        y = torch.tanh(lin(x))
    w0, g = lin.weight.detach().clone(), 1 - y.detach() ** 2
    with torch.no_grad():
        lin.weight.mul_(2.0)
        lin.bias.add_(1.0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, g @ (2 * w0))
    torch.testing.assert_close(lin.weight.grad, g.t() @ x.detach())
    torch.testing.assert_close(lin.bias.grad, g.sum(0))
    y = torch.tanh(lin(x))
    with torch.no_grad():
        lin.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _with(schedule: str, extra: list) -> object:
    return compose([b for b in BASE if not b.startswith("pipeline.schedule=")] + [f"pipeline.schedule={schedule}", *extra])


def test_the_simulator_straddles_as_declared_and_differs_from_1f1b_2bw_and_the_other_recipe():
    extra = ["pipeline.stages=4", "train.steps=3"]
    runs = {}
    for name in ("paci", "paci-recompute"):
        trainer, runs[name], _ = _simulate(_with(name, extra), 3)
        assert trainer.engine.staged.straddled == 2 * (3 + 2 + 1)  # batches 1 and 2, stages 0..2
    paci = runs["paci"]
    sync = _simulate(_with("1f1b", extra + ["delay=0"]), 3)[1]
    two_bw = _simulate(_with("2bw", extra), 3)[1]
    assert paci[0].train_loss == sync[0].train_loss  # batch 0: everything reads W(0)
    assert [r.train_loss for r in paci[:2]] == [r.train_loss for r in runs["paci-recompute"][:2]]  # no straddler yet
    for other in (sync, two_bw, runs["paci-recompute"]):
        assert abs(paci[2].train_loss - other[2].train_loss) > 1e-4


def test_ef_under_paci_is_efs_rule_on_each_stages_updates():
    """EF under PACI: every stage applies u(t) + lam (u(t) - u(t-1)) to its own update stream at its own step,
    u being the optimizer's own update from that stage's partly stale gradient (asyncpipe.schedules.paci). By
    hand: EF's first step is the plain one, so after it both runs hold the same weights and optimizer state, the
    second gradient is the same, and W2(EF) = W1 - u2 - lam (u2 - u1) with u1 = W0 - W1, u2 = W1 - W2(plain)."""
    import torch

    common = BASE + ["pipeline.stages=4", "train.steps=4", "optimizer=adamw", "train.warmup_frac=0"]
    weights = {}
    for name, extra in (("plain", []), ("ef", ["compensation=ef", "compensation.ef.lam=0.5"])):
        trainer, _, _ = _simulate(compose(common + extra), 0)
        eng = trainer.engine
        seen = [[p.detach().clone() for p in eng.params]]
        for _ in range(2):
            eng.train_step()
            seen.append([p.detach().clone() for p in eng.params])
        weights[name] = seen
    assert eng.staged.straddled == 3 + 2 + 1  # the second batch straddled on stages 0..2
    (w0, w1, plain2), (_, ef1, ef2) = weights["plain"], weights["ef"]
    for a, b, c, d, e in zip(w0, w1, plain2, ef1, ef2):
        torch.testing.assert_close(d, b, rtol=0, atol=0)
        u1, u2 = a - b, b - c
        torch.testing.assert_close(e, b - u2 - 0.5 * (u2 - u1), rtol=1e-5, atol=1e-7)


# -- parity with the pipeline engine (slow: one launch per world size) ---------------------------------------
def _launch(cfgs):
    from asyncpipe.spawn import Job, launch

    jobs = [Job(OmegaConf.merge(c, {"engine": "pipeline"}), None, show_progress=False) for c in cfgs]
    return launch(jobs, timeout_s=400)


def _check(cfg, result, rtol=1e-5):
    _, sim, sim_val = _simulate(cfg)
    hist = result["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    for h, s in zip(hist, sim):
        assert h["train_loss"] == pytest.approx(s.train_loss, rel=rtol), f"step {h['step']}"
        assert h["grad_norm"] == pytest.approx(s.grad_norm, rel=rtol), f"step {h['step']}"
    assert result["final_val_loss"] == pytest.approx(sim_val, rel=rtol)
    P = cfg.pipeline.stages
    stages = sorted(result["stages"], key=lambda st: st["stage"])
    assert [round(st["weight_versions_peak"]) for st in stages] == [1] * P  # one weight version
    straddled = [(P - 1 - s) * (STEPS - 1) for s in range(P)]
    assert [st["straddled_backwards"] for st in stages] == straddled
    recompute = cfg.pipeline.schedule == "paci-recompute"
    assert [st["recomputed_backwards"] for st in stages] == (straddled if recompute else [0] * P)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_paci_pipeline_matches_the_simulator_at_two_and_four_stages():
    two = [compose(BASE + ["pipeline.stages=2", "optimizer=adamw"]),
           compose(BASE + ["pipeline.stages=2", "optimizer=muon", "compensation=ef"]),
           _with("paci-recompute", ["pipeline.stages=2", "optimizer=adamw"])]  # fmt: skip
    four = [compose(BASE + ["pipeline.stages=4", "optimizer=adamw"]), _with("paci-recompute", ["pipeline.stages=4"])]
    for cfgs in (two, four):
        for cfg, result in zip(cfgs, _launch(cfgs)):
            _check(cfg, result)


def test_schedule_draws_paci_with_its_straddlers_marked(tmp_path):
    from asyncpipe.timelines.draw import draw_schedule
    from asyncpipe.timelines.orders import ideal_timeline

    P, m = 4, 4
    tl = ideal_timeline("paci", P, m, 3)
    marked = sorted((e.stage, e.micro_batch) for e in tl.events if e.straddle)
    assert marked == sorted((s, k) for s in range(P) for k in range(3 * m) if PACI.straddles(P, m, s, k))
    assert all(e.end - e.start == 2.0 for e in tl.events if e.straddle)  # a backward (2): nothing recomputed
    other = ideal_timeline("paci-recompute", P, m, 3)
    assert sorted((e.stage, e.micro_batch) for e in other.events if e.straddle) == marked
    assert all(e.end - e.start == 3.0 for e in other.events if e.straddle)  # B (2) + the recomputed F (1)
    two_bw = ideal_timeline("2bw", P, m, 3)
    assert tl.makespan == two_bw.makespan < other.makespan  # in place: 2BW's tick order at 2BW's cost
    text, files = draw_schedule("paci", P, m, 3, 1.0, 2.0, 1.0, None, tmp_path)
    assert "B4*" in text and "straddles" in text and all(f.exists() for f in files)


# -- resume: the micro-batches in flight at a checkpoint re-run on the W(b-1) they first read ------------------
RESUME = ["engine=pipeline", "pipeline.schedule=paci", "delay=1", "pipeline.clip=stage", "pipeline.stages=2",
          "train.micro_batches=2", "train.steps=8", "checkpoint.every=4", "train.eval_every=4", "device=cpu",
          "precision=fp32", "pipeline.threads=1", "optimizer=adamw", "optimizer.lr=4e-3"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resumed_paci_run_is_bit_identical_to_one_not_interrupted(tmp_path):
    """Stage 0 forwards micro-batch 8 (batch 4's first) on W(3), before the step that makes W(4) and the checkpoint
    at step 4. Resumed from it, that forward runs again on the W(3) the checkpoint kept: every loss equal. The same
    checkpoint without it (as written before this existed) resumes on W(4): the losses after step 4 move."""
    import shutil

    import torch

    from helpers import asyncpipe, losses

    ref = tmp_path / "ref"
    done = asyncpipe("train", *RESUME, f"run.dir={ref}")
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = ref / "checkpoints" / "step_00000004"
    parts = {p.name: torch.load(p, weights_only=False) for p in ckpt.glob("rank*.pt")}
    assert len(parts) == 2
    for name, old in (("kept", False), ("dropped", True)):
        run = tmp_path / name
        shutil.copytree(ref, run)
        (run / "summary.json").unlink()
        if old:  # a checkpoint from before: no previous weights on any rank
            for part, saved in parts.items():
                assert (saved["state"]["previous"] is None) == (part == "rank1.pt")  # the last stage never straddles
                torch.save({**saved, "state": {**saved["state"], "previous": None}}, run / ckpt.relative_to(ref) / part)
        again = asyncpipe("train", *RESUME, f"run.dir={run}", "resume=true")
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resumed from" in again.stdout
        if old:
            upto = lambda rows: [r for r in rows if r[0] <= 4]  # noqa: E731
            assert upto(losses(run)) == upto(losses(ref)) and losses(run) != losses(ref)
        else:
            assert losses(run) == losses(ref)  # exact float equality, every step and evaluation
