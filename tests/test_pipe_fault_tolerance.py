"""Fault tolerance of `engine=pipeline` (2 stages, delay 0 = 1F1B and delay 1 = 2BW, adamw with EF): a SIGKILL of
the whole process group then resume=true gives bit-identical losses; SIGTERM to the launcher checkpoints every rank
and exits 4; a partial checkpoint falls back to the previous one. Plus fast checks of the pieces: the resumed
2BW stream and the weight stash's checkpoint round trip."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from asyncpipe.schedules import twobw as sched
from asyncpipe.engines.pipeline.stash import WeightStash
from asyncpipe.timelines.timeline import simulate
from helpers import asyncpipe, cli_env, losses, read_metrics, read_summary, wait_for_step

RUN = [
    "engine=pipeline", "optimizer=adamw_ef", "train.steps=16", "checkpoint.every=4", "train.eval_every=6",
    "device=cpu", "precision=fp32", "pipeline.threads=1",
]  # fmt: skip


# -- the pieces, in pure Python / one process ------------------------------------------------------------------
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("P,m,N,S", [(2, 2, 5, 1), (2, 3, 6, 4), (3, 3, 4, 2), (4, 5, 3, 1)])
def test_resumed_2bw_stream_is_the_tail_of_the_full_one(P, m, N, S, defer):
    full = [sched.two_bw_stream(m, P, s, N, defer_step=defer) for s in range(P)]
    tail = [sched.flatten(sched.TwoBWSchedule(m, P, s, N, defer, start=S).steps()) for s in range(P)]
    simulate(tail, collective_steps=True)  # sends meet receives, nothing left over
    for whole, resumed in zip(full, tail):
        def work(stream):  # what touches weights: forwards/backwards with their pinned versions, and steps
            kinds = (sched.ForwardPass, sched.BackwardPass, sched.OptimizerStep)
            return [c for c in stream if isinstance(c, kinds) and c.kwargs.get("micro_batch", S * m) >= S * m
                    and c.kwargs.get("batch", S) >= S]  # fmt: skip
        assert work(resumed) == work(whole)
        assert [c.micro_batch for c in resumed if isinstance(c, sched.ForwardPass)] == list(range(S * m, N * m))
        assert [c.version for c in resumed if isinstance(c, sched.ForwardPass)][:m] == [S - 1] * m


def test_stash_checkpoint_round_trip_continues_identically():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = [torch.randn(5, 4) for _ in range(6)]

    def run_batch(stash: WeightStash, opt: torch.optim.Optimizer, b: int) -> None:
        version = max(b - 1, 0)
        with stash.use(version):
            net(xs[b]).square().sum().backward()
        stash.release(version)
        grads = stash.take_grads(version)
        stash.begin_update(b, b + 1)
        for p, g in zip(stash.params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        stash.end_update(b + 1)

    twin = copy.deepcopy(net)
    stash = WeightStash(net, delay=1)
    opt = torch.optim.Adam(stash.params, lr=0.1)
    for b in range(3):
        run_batch(stash, opt, b)
    saved, opt_saved = copy.deepcopy(stash.state_dict()), copy.deepcopy(opt.state_dict())  # as torch.save would
    assert sorted(saved["versions"]) == [2, 3] and saved["latest"] == 3
    for b in range(3, 6):
        run_batch(stash, opt, b)
    expected = [p.detach().clone() for p in stash.params]

    net = twin  # a fresh process: the same initial module, then the checkpoint
    fresh = WeightStash(net, delay=1)
    fresh_opt = torch.optim.Adam(fresh.params, lr=0.1)
    fresh.load_state_dict(saved)
    fresh_opt.load_state_dict(opt_saved)
    for b in range(3, 6):
        run_batch(fresh, fresh_opt, b)
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, expected))


# -- end to end: `asyncpipe train engine=pipeline` in its own session, killed and resumed ----------------------
def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # its own session and process group: killpg reaches the ranks too
        return subprocess.Popen([sys.executable, "-m", "asyncpipe", "train", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True)  # fmt: skip


def _alive_in_group(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    runs = {}
    for delay in (0, 1):
        run = tmp_path_factory.mktemp("pipe-ft") / f"reference-d{delay}"
        proc = asyncpipe("train", *RUN, f"delay={delay}", f"run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[delay] = run
    return runs


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 1])
def test_sigkill_of_every_rank_then_resume_is_bit_identical(references, tmp_path: Path, delay: int) -> None:
    run = tmp_path / "killed"
    args = [*RUN, f"delay={delay}", f"run.dir={run}"]
    proc = _start(args, tmp_path / "log")
    wait_for_step(run, 10, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while _alive_in_group(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert _alive_in_group(proc.pid) == [], "ranks survived the kill of their launcher's process group"
    assert not (run / "summary.json").exists()
    done = asyncpipe("train", *args, "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stdout
    assert losses(run) == losses(references[delay])  # exact float equality, every step and every evaluation
    assert read_summary(run)["final_val_loss"] == read_summary(references[delay])["final_val_loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_checkpoints_every_rank_exits_4_then_resumes(references, tmp_path: Path) -> None:
    run = tmp_path / "preempted"
    args = [*RUN, "delay=1", f"run.dir={run}"]
    proc = _start(args, tmp_path / "log")
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher only: it forwards the signal to its ranks
    assert proc.wait(timeout=120) == 4, (tmp_path / "log").read_text()[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and 5 <= summary["steps"] < 16
    ckpt = run / "checkpoints" / f"step_{summary['steps']:08d}"
    assert {f.name for f in ckpt.iterdir()} >= {"COMPLETE", "rank0.pt", "rank1.pt"}
    done = asyncpipe("train", *args, "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {ckpt}" in done.stdout
    assert losses(run) == losses(references[1])


def unfinished_copy(reference: Path, run: Path) -> Path:
    """A completed reference run dir, copied and made to look unfinished (as after a crash)."""
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_partial_checkpoint_falls_back_to_the_previous_one(references, tmp_path: Path) -> None:
    run = unfinished_copy(references[1], tmp_path / "partial")
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_00000008", "step_00000012"]  # every=4, keep=2, none at the end
    (ckpts[-1] / "rank1.pt").unlink()  # a crash after rank 0's part (the marker alone is not trusted)
    proc = asyncpipe("train", *RUN, "delay=1", f"run.dir={run}", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"checkpoint {ckpts[-1].name} is incomplete (missing rank1.pt)" in proc.stdout
    assert f"resumed from {ckpts[-2]}" in proc.stdout
    assert losses(run) == losses(references[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_part_on_another_rank_falls_back_on_every_rank(references, tmp_path: Path) -> None:
    run = unfinished_copy(references[1], tmp_path / "corrupt")
    older, newest = sorted((run / "checkpoints").iterdir())
    (newest / "rank1.pt").write_bytes(b"not a checkpoint")
    proc = asyncpipe("train", *RUN, "delay=1", f"run.dir={run}", "resume=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    named = f"checkpoint {newest.name} cannot be used (checkpoint {newest / 'rank1.pt'} cannot be read safely"
    assert named in proc.stdout  # rank 0 says it, naming rank 1's part
    assert f"resumed from {older}" in proc.stdout
    assert losses(run) == losses(references[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_parts_with_no_earlier_checkpoint_are_a_one_line_error(references, tmp_path: Path) -> None:
    run = unfinished_copy(references[1], tmp_path / "corrupt")
    for part in run.glob("checkpoints/step_*/rank1.pt"):
        part.write_bytes(b"not a checkpoint")
    before = read_metrics(run)
    proc = asyncpipe("train", *RUN, "delay=1", f"run.dir={run}", "resume=true")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank1.pt cannot be read" in lines[0], proc.stderr[-2000:]
    assert "no earlier checkpoint can be resumed from" in lines[0]
    assert read_metrics(run) == before  # no rank truncated anything


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_divergence_is_agreed_at_a_cut_and_ends_the_run(tmp_path: Path) -> None:
    run = tmp_path / "div"
    proc = asyncpipe("train", *RUN, "delay=1", "train.diverge_loss=5.0", f"run.dir={run}")
    assert proc.returncode == 3, proc.stderr[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["steps"] < 16
    metrics = [m for m in read_metrics(run) if "train_loss" in m]
    assert metrics[-1]["train_loss"] > 5.0 and all(m["train_loss"] <= 5.0 for m in metrics[:-1])
