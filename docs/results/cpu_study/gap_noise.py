"""Seed noise of the loss gaps in docs/results/cpu_study.md: per-seed (paired) gaps from a study's run dirs.

`asyncpipe report` gives mean ± std per cell; a gap's spread needs the runs themselves. Seeds fix the init and
the data order, so a seed's async run is compared with the same seed's sync run (paired), and the unpaired
standard error sqrt(s_a^2/n_a + s_s^2/n_s) is printed beside it. Two more paired tables follow: EF's effect
(EF run - 1-step run) and, for PipeDream runs, PipeDream - 2BW (pipedream(P) run - 1-step run), same seed.
Usage: python docs/results/cpu_study/gap_noise.py runs/study/cpu_study [more sweep dirs: their runs join the same
table, e.g. runs/study/pipedream_depth, whose PipeDream runs are compared with cpu_study's sync runs]
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import yaml


def variant(cfg: dict) -> str:
    if int(cfg.get("delay") or 0) == 0:
        name = "sync"
    elif cfg.get("delay_profile") == "pipedream":
        name = f"pipedream(P={cfg['pipeline']['stages']})"
    else:
        name = f"{cfg['delay']}-step"
    return name + ("+EF" if cfg["optimizer"].get("ef", {}).get("enabled") else "")


def std(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def main(roots: list[Path]) -> None:
    loss: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for summary in sorted(p for root in roots for p in root.rglob("summary.json")):
        s = json.loads(summary.read_text())
        if s.get("status") != "completed":
            continue
        cfg = yaml.safe_load((summary.parent / "config.yaml").read_text())
        loss[(cfg["optimizer"]["name"], variant(cfg))][int(cfg["seed"])] = float(s["final_val_loss"])
    print("| optimizer | variant | n | gap to sync (mean of per-seed gaps) | std of per-seed gaps | unpaired s.e. |")
    print("|---|---|---|---|---|---|")
    for (opt, var), runs in sorted(loss.items()):
        sync = loss.get((opt, "sync"), {})
        if var == "sync" or not sync:
            continue
        gaps = [runs[k] - sync[k] for k in sorted(runs) if k in sync]
        a, b = list(runs.values()), list(sync.values())
        se = math.sqrt(std(a) ** 2 / len(a) + std(b) ** 2 / len(b)) if len(a) > 1 and len(b) > 1 else math.nan
        print(f"| {opt} | {var} | {len(gaps)} | {sum(gaps) / len(gaps):+.4f} | {std(gaps):.4f} | {se:.4f} |")
    # EF's effect on its own: the same seed's 1-step+EF run minus its 1-step run (the sync run cancels out).
    print("\n| optimizer | EF run - 1-step run, same seed (mean) | std | n |\n|---|---|---|---|")
    for (opt, var), runs in sorted(loss.items()):
        base = loss.get((opt, var.replace("+EF", "")), {}) if var.endswith("+EF") else {}
        diffs = [runs[k] - base[k] for k in sorted(runs) if k in base]
        if diffs:
            print(f"| {opt} | {sum(diffs) / len(diffs):+.4f} | {std(diffs):.4f} | {len(diffs)} |")
    # PipeDream against 2BW's uniform 1-step delay: the same seed's pipedream(P) run minus its 1-step run.
    rows = []
    for (opt, var), runs in sorted(loss.items(), key=lambda kv: (kv[0][0], len(kv[0][1]), kv[0][1])):
        base = loss.get((opt, "1-step"), {}) if var.startswith("pipedream") else {}
        diffs = [runs[k] - base[k] for k in sorted(runs) if k in base]
        if diffs:
            rows.append(f"| {opt} | {var} | {sum(diffs) / len(diffs):+.4f} | {std(diffs):.4f} | {len(diffs)} |")
    if rows:
        print("\n| optimizer | variant | run - 1-step (2BW) run, same seed (mean) | std | n |\n|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
