"""The run config's trip (issue 51): `asyncpipe train model=tiny train.steps=2` on engine=simulate, from `cli.main`
to the engine and back, climbs from a module to one in a higher layer (`LAYERS` in tests/test_imports.py) at most
`MAX_CLIMBS` times, counted as distinct (caller module, callee module) pairs of the package.

The run is profiled (`sys.setprofile`) in the process that runs it: every Python call into a module of the package
is charged to the nearest module of the package below it on the stack. A module's first import counts as a call from
the module that imported it, so the run is measured in a fresh interpreter (this file run as a script): what this
test session imported before would hide those climbs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Optional

MAX_CLIMBS = 8
TRIP = ["train", "model=tiny", "train.steps=2", "tracker.wandb.mode=disabled", "engine=simulate"]
# The trip reached the run's owner and its engine (a config refused early would climb little, and prove nothing).
REACHED = ("asyncpipe.cli", "asyncpipe.config.compose", "asyncpipe.trainer", "asyncpipe.engines.simulator")


def _package_module(frame: Optional[FrameType]) -> Optional[str]:
    """The module of the nearest frame from ``frame`` down the stack that runs the package's code."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "asyncpipe" or name.startswith("asyncpipe."):
            return name
        frame = frame.f_back
    return None


def trip(argv: list[str]) -> dict[str, Any]:
    """Run ``asyncpipe.cli.main(argv)`` under a profiler: its exit code, the package's modules it entered and the
    (caller, callee) module pairs whose callee is in a higher layer, with how many calls each made."""
    from test_imports import layer_of

    from asyncpipe.cli import main

    entered: set[str] = set()
    climbs: dict[tuple[str, str], int] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name != "asyncpipe" and not name.startswith("asyncpipe."):
            return
        entered.add(name)
        caller = _package_module(frame.f_back)
        if caller is not None and caller != name and layer_of(name) > layer_of(caller):
            climbs[(caller, name)] = climbs.get((caller, name), 0) + 1

    code: Any = 0
    sys.setprofile(profile)
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.setprofile(None)
    pairs = [[caller, callee, n] for (caller, callee), n in sorted(climbs.items())]
    return {"code": code, "entered": sorted(entered), "climbs": pairs}


def _measure(run_dir: Path) -> dict[str, Any]:
    """`trip` of the train command in a fresh interpreter (this file as a script), its result as JSON. The data set
    is prepared first, in a process of its own: the trip measured is a run's on prepared data, whatever the tests
    before this one prepared (preparing calls the run's progress log, one more climb, the first time only)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONSAFEPATH", None)
    prepare = subprocess.run(
        [sys.executable, "-m", "asyncpipe", "data", "prepare"], env=env, capture_output=True, text=True, timeout=300
    )
    assert prepare.returncode == 0, prepare.stdout[-2000:] + prepare.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, __file__, str(run_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_config_trip_climbs_back_up_at_most_8_times(tmp_path: Path) -> None:
    result = _measure(tmp_path / "run")
    assert result["code"] in (0, None), result
    assert (tmp_path / "run" / "summary.json").is_file()
    assert set(REACHED) <= set(result["entered"]), set(REACHED) - set(result["entered"])
    print(
        f"\n{len(result['climbs'])} climbing (caller -> callee) module pairs, {len(result['entered'])} modules entered:"
    )
    for caller, callee, n in result["climbs"]:
        print(f"  {caller} -> {callee} ({n} calls)")
    assert len(result["climbs"]) <= MAX_CLIMBS, [f"{a} -> {b}" for a, b, _ in result["climbs"]]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(trip([*TRIP, f"run.dir={sys.argv[1]}"])))
