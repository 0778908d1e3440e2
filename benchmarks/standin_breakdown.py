"""Where a stand-in step's time goes (issue 39, item 5): traced stand-in runs of 2BW and 1F1B, each steady
window split along its critical path (`asyncpipe.bench.critical_path`), beside what gloo's p2p round trip and a
padding sleep cost in isolation on the same machine at the same moment. Short: a few steps per job.

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/standin_breakdown.py                # P = 2, 4; m = P, 2P
    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/standin_breakdown.py --stages 2 --micro 1 --isolated-only

Prints one table (ms per micro-batch on the critical path, by part) and writes the JSON (--out). Every figure is
taken under whatever load the machine has: the `uptime` before and after is printed and saved with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.split("load average:")[-1].strip()
    except OSError:
        return "?"


# -- in isolation: a sleep's overshoot, gloo's round trip ---------------------------------------------------
def sleep_overshoot(seconds: float = 0.02, n: int = 50) -> dict:
    """Overshoot of a plain `time.sleep` and of the stand-in pad's sleep to a deadline (`sleep_until`), seconds."""
    from asyncpipe.engines.pipeline.standin import sleep_until

    plain, pad = [], []
    for _ in range(n):
        a = time.perf_counter()
        time.sleep(seconds)
        plain.append(time.perf_counter() - a - seconds)
        a = time.perf_counter()
        sleep_until(a + seconds)
        pad.append(time.perf_counter() - a - seconds)
    q = lambda xs: {"median": statistics.median(xs), "p90": sorted(xs)[int(0.9 * len(xs))], "max": max(xs)}  # noqa: E731
    return {"seconds": seconds, "n": n, "time_sleep": q(plain), "sleep_until": q(pad)}


def _gloo_cases(rank: int, port: int, numel: int, n: int, pause: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(numel)
    t = torch.zeros(1, dtype=torch.float64)
    cases: dict[str, list[float]] = {"blocked_receiver": [], "receive_at_wait": [], "receive_ahead": []}
    for _ in range(n):
        # The receiver waits first; the sender posts ``pause`` later: its post (clock sent along) to the
        # receiver's return, the latency of a message to a blocked stage (wake-ups included).
        dist.barrier()
        if rank == 1:
            time.sleep(pause)
            t[0] = time.perf_counter()
            dist.send(t, 0)
        else:
            dist.recv(t, 1)
            cases["blocked_receiver"].append(time.perf_counter() - t.item())
        # The sender first: the receive posted only when the receiver waits (gloo's rendezvous then runs), or
        # posted ``pause`` earlier (the data is there when it waits).
        for case in ("receive_at_wait", "receive_ahead"):
            dist.barrier()
            if rank == 1:
                dist.isend(x, 0).wait()
                continue
            work = dist.irecv(x, 1) if case == "receive_ahead" else None
            time.sleep(pause)
            a = time.perf_counter()
            (work or dist.irecv(x, 1)).wait()
            cases[case].append(time.perf_counter() - a)
    if rank == 0:
        Path(out).write_text(json.dumps(cases))
    dist.destroy_process_group()


def gloo_latency(numel: int, n: int = 60, pause: float = 0.01) -> dict:
    """Seconds (median, p90) a ``numel``-float message over gloo between two processes costs its receiver in
    three cases (`_gloo_cases`): ``blocked_receiver``, ``receive_at_wait``, ``receive_ahead``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gloo.json")
        mp.start_processes(_gloo_cases, args=(port, numel, n, pause, out), nprocs=2, start_method="spawn")
        cases = json.loads(Path(out).read_text())
    q = lambda xs: {"median": statistics.median(xs), "p90": sorted(xs)[int(0.9 * len(xs))]}  # noqa: E731
    return {"numel": numel, "n": n, "pause_s": pause, **{k: q(v) for k, v in cases.items()}}


# -- traced stand-in runs ------------------------------------------------------------------------------------
def traced_runs(P: int, ms: list[int], schedules: list[str], F: float, B: float, steps: int,
                keep: Path | None = None) -> list[dict]:
    """One launch per P: a job per (schedule, m) with pipeline.trace=true; each job's steady window (stage 0's
    cuts after the first batch up to the last but one) split on its critical path and per stage."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from asyncpipe.bench import critical_path as cp
    from asyncpipe.bench.pipeline import BENCH_DEFAULTS, variants_of
    from asyncpipe.bench.standin import ideal_step_s, standin_overrides
    from asyncpipe.config import compose
    from asyncpipe.spawn import Job, launch

    table = variants_of(schedules)
    base = [*BENCH_DEFAULTS, "model=tiny", f"model.n_layer={max(4, 2 * P)}", f"pipeline.stages={P}",
            "train.micro_batch_size=1", "train.seq_len=16", *standin_overrides(F, B), "engine=pipeline",
            f"train.steps={steps}", f"train.eval_every={steps}", "pipeline.trace=true", f"train.eval_batches={2 * P}",
            "tracker.wandb.mode=disabled"]  # fmt: skip
    keys = [(name, m) for m in ms for name in table]
    out = []
    with tempfile.TemporaryDirectory(prefix="standin-breakdown-") as scratch:
        tmp = tempfile.mkdtemp(prefix=f"P{P}-", dir=keep) if keep else scratch
        jobs = [Job(compose([*base, *table[name], f"train.micro_batches={m}"]), Path(tmp) / f"{name}-{m}",
                    show_progress=False) for name, m in keys]  # fmt: skip
        for j in jobs:
            j.run_dir.mkdir()
        load_before = _uptime()
        launch(jobs)
        load_after = _uptime()
        for (name, m), job in zip(keys, jobs):
            traces = {}
            for f in job.run_dir.glob("trace-rank*.json"):
                ev = json.loads(f.read_text())
                if ev and ev[0].get("replica", 0) == 0:
                    traces[ev[0]["stage"]] = sorted((e for e in ev if ":" not in e["op"]), key=lambda e: e["start"])
            cuts = cp.cut_times(traces[0])
            # From batch 1's cut (batch 0's first optimizer step, which builds the optimizer state, is before it)
            # to the last batch's start: steady batches only.
            t0, t1 = cuts[1], cuts[-2]
            batches = len(cuts) - 3
            ideal = ideal_step_s(job.cfg.pipeline.schedule, P, m, F, B)
            path = cp.critical_path(traces, t0, t1, (F, B))
            out.append({
                "schedule": name, "stages": P, "micro_batches": m, "forward_s": F, "backward_s": B,
                "steady_batches": batches, "step_s": (t1 - t0) / batches, "ideal_step_s": ideal,
                "fraction_of_ideal": ideal * batches / (t1 - t0),
                "critical_path_s_per_step": {k: v / batches for k, v in path["parts"].items()},
                "critical_path_hops_per_step": path["hops"] / batches,
                "message_s_median": statistics.median(path["message_s"]) if path["message_s"] else 0.0,
                "per_stage_s_per_step": {s: {k: v / batches for k, v in p.items()}
                                         for s, p in cp.per_stage(traces, t0, t1, (F, B)).items()},
                "load_before": load_before, "load_after": load_after,
            })  # fmt: skip
    return out


LOST = ("optimizer_step", "reduce", "cut", "message", "commit", "load", "overshoot", "between", "other")
HEAD = ["schedule", "P", "m", "ideal ms", "step ms", "fraction", "lost ms/step", "opt. step", "reduce", "cut",
        "message", "commit", "load", "overshoot", "between", "other", "compute beyond ideal", "hops/step"]  # fmt: skip
MARKS = ("<!-- standin-breakdown:start -->", "<!-- standin-breakdown:end -->")
DOC = REPO / "docs" / "performance.md"
JSON = REPO / "benchmarks" / "results" / "standin-breakdown.json"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def render(res: dict) -> str:
    """The doc's section body: the isolated figures, then per record the step's loss against its ideal split
    along the critical path (ms per step; "compute beyond ideal": configured compute the path crosses beyond
    the ideal's, the window's two ends falling at different points of the rhythm)."""
    sl, g = res["sleep"], res["gloo"]
    q = lambda d: f"{d['median'] * 1e3:.3f} ms (p90 {d['p90'] * 1e3:.3f})"  # noqa: E731
    lines = [
        f"Measured: {res['measured_at']}, commit {res['commit']}, load {res['load_before']} before, "
        f"{res['load_after']} after; F = {_ms(res['forward_s'])} ms, B = {_ms(res['backward_s'])} ms, "
        f"{res['steps']} steps per job, window from stage 0's second cut to its last but one "
        "(`benchmarks/standin_breakdown.py --update-doc`).",
        "",
        f"In isolation, same moment: a {_ms(sl['seconds'])} ms `time.sleep` overshoots by a median {q(sl['time_sleep'])}, "
        f"the pad's `sleep_until` by {q(sl['sleep_until'])}; a {g['numel']}-float gloo message costs its receiver "
        f"{q(g['blocked_receiver'])} when it was blocked waiting (post to return), {q(g['receive_at_wait'])} after "
        f"a sender that came first when the receive is posted at the wait, {q(g['receive_ahead'])} when it was "
        "posted ahead.",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "---|" * len(HEAD),
    ]  # fmt: skip
    for r in res["records"]:
        parts, ideal = r["critical_path_s_per_step"], r["ideal_step_s"]
        lines.append("| " + " | ".join([
            r["schedule"], str(r["stages"]), str(r["micro_batches"]), _ms(ideal), _ms(r["step_s"]),
            f"{r['fraction_of_ideal']:.3f}", _ms(r["step_s"] - ideal), *(_ms(parts[k]) for k in LOST),
            _ms(parts["wait"] - ideal), f"{r['critical_path_hops_per_step']:.1f}"]) + " |")  # fmt: skip
    return "\n".join(lines)


def update_doc(body: str) -> None:
    text = DOC.read_text()
    a, b = text.index(MARKS[0]) + len(MARKS[0]), text.index(MARKS[1])
    DOC.write_text(text[:a] + "\n" + body + "\n" + text[b:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--micro", default="1,2", help="m as multiples of P")
    ap.add_argument("--schedules", default="2bw,1f1b")
    ap.add_argument("--standin", default="0.02,0.04")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--keep", type=Path, default=None, help="keep the traced run dirs under this folder")
    ap.add_argument("--isolated-only", action="store_true", help="only the sleep and gloo figures")
    ap.add_argument("--out", type=Path, default=None, help=f"the JSON (default with --update-doc: {JSON.relative_to(REPO)})")
    ap.add_argument("--update-doc", action="store_true", help="write the JSON and docs/performance.md's section")
    ap.add_argument("--from-json", action="store_true", help="re-render the saved JSON (with --update-doc: into the doc)")
    a = ap.parse_args()
    if a.from_json:
        body = render(json.loads((a.out or JSON).read_text()))
        print(body)
        if a.update_doc:
            update_doc(body)
        return
    F, B = (float(x) for x in a.standin.split(","))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    res: dict = {"forward_s": F, "backward_s": B, "steps": a.steps, "commit": commit[:12], "load_before": _uptime()}
    res["sleep"] = sleep_overshoot(F)
    res["gloo"] = gloo_latency(16 * 64)
    res["records"] = []
    if not a.isolated_only:
        for P in (int(x) for x in a.stages.split(",")):
            res["records"] += traced_runs(P, [k * P for k in (int(x) for x in a.micro.split(","))],
                                          a.schedules.split(","), F, B, a.steps, a.keep)  # fmt: skip
    res["load_after"] = _uptime()
    res["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = render(res)
    print(body)
    out = a.out or (JSON if a.update_doc else None)
    if out:
        out.write_text(json.dumps(res, indent=1) + "\n")
    if a.update_doc:
        update_doc(body)


if __name__ == "__main__":
    main()
