"""The memory plan as `asyncpipe plan` prints it: one row per stage (GiB against the budget), its legend and notes,
and the one-line verdict that ends the output; `BUBBLE_LEGEND` explains the schedules table that `--speed` adds."""

from __future__ import annotations

from typing import Any, Optional

from asyncpipe.plan import GIB, Plan


def verdict(pl: Plan) -> str:
    """One line: whether the run fits (its largest stage against the budget) and, when not, what does not."""
    budget = pl.gpu_mem_gib * GIB
    top = max(pl.stages, key=lambda s: s.total)
    over = [s.stage for s in pl.stages if s.total > budget]
    problems = []
    if over:
        names = ", ".join(map(str, over))
        largest = min((s.max_micro_batch for s in pl.stages if s.stage in over), default=0)
        fix = f"train.micro_batch_size={largest} or less" if largest > 0 else "more stages or a larger --gpu-mem"
        problems.append(
            f"stage{'s' if len(over) > 1 else ''} {names} need{'' if len(over) > 1 else 's'} up to "
            f"{top.total / GIB:.1f} GiB of {pl.gpu_mem_gib:g} GiB ({fix})"
        )
    if not pl.runs:
        problems.append("2BW needs train.micro_batches >= pipeline.stages")
    if problems:
        return "verdict: does NOT fit: " + "; ".join(problems)
    return (
        f"verdict: fits: every stage within {pl.gpu_mem_gib:g} GiB per device (largest: stage {top.stage}, "
        f"{top.total / GIB:.1f} GiB)"
    )


def layer_label(layers: tuple[int, int], n_layer: int) -> str:
    """A stage's [first, last) range of the layer list [embedding, blocks, head] as ``emb+b0-b2``, ``b3-b5+head``."""
    first, last = layers
    parts = ["emb"] if first == 0 else []
    lo, hi = max(first, 1) - 1, min(last, n_layer + 1) - 2  # block indices
    if hi >= lo:
        parts.append(f"b{lo}" if hi == lo else f"b{lo}-b{hi}")
    if last == n_layer + 2:
        parts.append("head")
    return "+".join(parts)


def render(pl: Plan, cfg: Optional[Any] = None) -> str:
    """The plan as a text table (GiB), one row per stage."""
    g = lambda b: f"{b / GIB:.3f}" if b < 10 * GIB else f"{b / GIB:.1f}"  # noqa: E731
    lines = [
        f"model {pl.model}: {pl.total_params / 1e6:,.2f}M parameters, {pl.active_params / 1e6:,.2f}M active per token"
    ]
    if cfg is not None:
        from asyncpipe.registry import describe

        t, p = cfg.train, cfg.pipeline
        lines.append(
            f"{pl.schedule} on {p.stages} stages x {p.data_parallel} {plural(p.data_parallel, 'replica')} | micro-batch {t.micro_batch_size} x "
            f"{t.seq_len} tokens, {t.micro_batches} per step | {describe(cfg)} | budget {pl.gpu_mem_gib:g} GiB per device"
        )
    head = (
        "stage",
        "layers",
        "params",
        "ver",
        "weights",
        "grads",
        "optim",
        "EF/comp",
        "in-flight",
        "activ",
        "bf16 w",
        "total",
        "fits",
        "max mb",
    )
    rows = [head]
    for s in pl.stages:
        ok = s.total <= pl.gpu_mem_gib * GIB
        label = " & ".join(layer_label(c, pl.n_layer) for c in (s.chunks or [s.layers]))
        rows.append(
            (
                str(s.stage),
                label,
                f"{s.params / 1e6:.2f}M",
                str(s.versions),
                g(s.weights),
                g(s.grads),
                g(s.optimizer),
                g(s.ef),
                str(s.in_flight),
                g(s.activations),
                g(s.casts),
                g(s.total),
                "yes" if ok else "NO",
                str(s.max_micro_batch),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        "layers: transformer blocks b0..b{n}; emb (token embedding) and head (final norm + output layer) "
        "are the layer list's first and last entries, partitioned like blocks".format(n=pl.n_layer - 1)
    )
    lines.append("GiB per device; in-flight: micro-batches whose activations a stage holds (min(P - s, m));")
    lines.append("bf16 w: bf16 autocast's copy of the stage's matmul weights, kept by each in-flight micro-batch;")
    lines.append("max mb: the largest micro-batch size (sequences) whose total fits the budget.")
    lines += [f"note: {n}" for n in pl.notes]
    lines.append(verdict(pl))
    return "\n".join(lines)


BUBBLE_LEGEND = (
    "bubble: the least busy stage's idle share of a steady step under the cost model (1 - its busy "
    "time / step time):\n  the flush's (P-1)/(m+P-1) plus per-instruction overhead, p2p waits and uneven "
    "stages, so it can exceed that formula, and 2BW's (no flush) is not 0;\n  x even: step time of an even "
    "cut over this cut's."
)  # the schedules table's legend (`asyncpipe plan --speed`)


def plural(n: int, word: str) -> str:
    return word if n == 1 else f"{word}s"
