"""One large file cut into units of work, so a 10 GB file keeps every worker busy: an uncompressed JSON Lines file
(or text split on `data.separator`) into byte ranges that each end just after a document, a Parquet file into runs
of whole row groups.

A cut depends on the file and the range size only (never on `data.workers`), and a range read alone yields exactly
the documents a reading of the whole file gives it, at the same offsets: ranges are read in parallel, resumed one by
one, and their concatenation is the file's. Compressed files stay whole (a stream cannot be entered midway).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from asyncpipe.data.sources import COMPRESSED, SourceError, file_format

SCAN = 1 << 20  # bytes read at a time while looking for a document's end


def splittable(path: Path, fmt: str, separator: str) -> str:
    """How the file can be cut: "lines" (uncompressed JSON Lines), "separator" (uncompressed text with one),
    "row groups" (Parquet), or "" (kept whole: compressed, or a document per file)."""
    kind = file_format(path, fmt)
    if kind == "parquet":
        return "row groups"
    if path.name.lower().endswith(COMPRESSED):
        return ""
    if kind == "jsonl":
        return "lines"
    return "separator" if kind == "text" and separator else ""


def byte_spans(path: Path, size: int, range_bytes: float, separator: str) -> list[tuple[int, int]]:
    """[start, end) ranges covering the file, each about `range_bytes` or more and each ending just after a document
    (a separator that a reading from the file's start takes as one; without one, a line's newline)."""
    parts = int(size // range_bytes)
    if parts < 2:
        return [(0, size)]
    sep = separator.encode("utf-8") if separator else b"\n"
    cuts = [0]
    try:
        with open(path, "rb") as f:
            for k in range(1, parts):
                nominal = size * k // parts
                if nominal <= cuts[-1]:  # the last document's end lies beyond this cut already
                    continue
                cut = _boundary(f, nominal, sep)
                if cut >= size:
                    break
                cuts.append(cut)
    except OSError as err:
        raise SourceError(f"{path}: cannot be read ({err.strerror})") from None
    return list(zip(cuts, cuts[1:] + [size]))


def _boundary(f: BinaryIO, at: int, sep: bytes) -> int:
    """The first document boundary at or after byte `at` (the file's size when there is none): the end of an
    occurrence of `sep` that starts at q >= at - len(sep) with no occurrence starting in (q - len(sep), q). Reading
    from the start splits on the leftmost occurrences, never on one that overlaps the one before it (a separator
    like "\\n\\n" overlaps itself in "\\n\\n\\n"); an occurrence that overlaps none before it is always taken."""
    n = len(sep)
    base = max(0, at - 2 * n + 1)  # from here the bytes before the first candidate are in the buffer too
    f.seek(base)
    buf = f.read(SCAN)
    lo = at - n - base
    while True:
        i = buf.find(sep, max(0, lo))
        while i != -1:
            if not any(buf.startswith(sep, j) for j in range(max(0, i - n + 1), i)):
                return base + i + n
            i = buf.find(sep, i + 1)
        more = f.read(SCAN)
        if not more:
            return base + len(buf)
        tail = (
            buf[max(0, len(buf) - (2 * n - 2)) :] if n > 1 else b""
        )  # an occurrence across the two reads, and its check
        base += len(buf) - len(tail)
        buf, lo = tail + more, len(tail) - n + 1


def row_group_spans(groups: list[int], range_bytes: float) -> list[tuple[int, int]]:
    """[first, end) runs of a Parquet file's row groups (`groups`: each one's bytes on disk), each `range_bytes` or
    more but the last."""
    spans, start, acc = [], 0, 0
    for g, nbytes in enumerate(groups):
        acc += nbytes
        if acc >= range_bytes:
            spans.append((start, g + 1))
            start, acc = g + 1, 0
    return spans + ([(start, len(groups))] if start < len(groups) else [])
