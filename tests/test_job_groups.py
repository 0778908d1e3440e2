"""A rank runs its launch's jobs back to back in one process: what one job sets up for its collectives must not
outlive it (`asyncpipe.dist.job_groups`, `ScheduledPipelineEngine.release`). Measured before the fix: every job of
a stand-in launch left its process groups' gloo threads in each rank (about 670 threads per rank after 42 jobs at
P = 8, load average above 200 on 2 cores), and the last stage kept each finished engine alive."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_groups_made_by_a_job_are_destroyed_and_older_ones_kept() -> None:
    code = textwrap.dedent("""
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("asyncpipe.dist").dist.free_port()),
                          RANK="0", WORLD_SIZE="1")
        import torch.distributed as tdist
        from asyncpipe.dist import groups_alive, init_process_group, job_groups

        def threads():
            return int(next(l for l in open("/proc/self/status") if l.startswith("Threads")).split()[1])

        with job_groups():  # the first job also initialises the default group, as a rank's first `train` does
            init_process_group("gloo")
            kept = tdist.new_group([0])
        assert groups_alive() == [], groups_alive()
        kept = tdist.new_group([0])  # made outside any job: not a job's to destroy
        base = threads()
        for job in range(3):
            with job_groups():
                for _ in range(4):
                    tdist.all_reduce(__import__("torch").ones(1), group=tdist.new_group([0]))
                assert len(groups_alive()) == 5
            assert groups_alive() == [kept], groups_alive()
            assert threads() <= base, (job, threads(), base)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
