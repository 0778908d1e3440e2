"""Documents read from your own files (`data=files`): plain text (a document per file, or split on a declared
separator), JSON Lines and Parquet (a named text field or column), each optionally gzip- or zstd-compressed.

Every reader streams: it yields batches of documents with the input bytes consumed so far and each document's
place in the file (its byte offset in the decompressed text, or its Parquet row), never the whole file (except a
document-per-file text, whose document is the file). A reader can read a part of a file (`asyncpipe.data.ranges`
cuts them). A bad file is one `UserError` line naming the file and, where there is one, the line or row.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from asyncpipe.errors import UserError

FORMATS = ("auto", "text", "jsonl", "parquet")
_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
COMPRESSED = (".gz", ".zst", ".zstd")
BATCH_BYTES = 1 << 20  # text per yielded batch: bounds a worker's memory (token lists included)
_SNIFF = 8192  # bytes looked at for a NUL (a binary file)

Batch = tuple[list[str], int, list[int]]  # documents, input bytes read so far (on disk: compressed), their places
Span = tuple[int, int]  # [start, end) bytes of an uncompressed file, or row groups of a Parquet file


class SourceError(UserError):
    """A file of the corpus that cannot be read as declared: one line naming it (and the line or row)."""


def expand_paths(patterns: list[str], what: str = "data.paths") -> list[Path]:
    """The files `patterns` name (globs, `**` included; a directory means every file under it, hidden ones left
    out), sorted within each pattern, each once; a pattern that matches no file is an error."""
    if not patterns:
        raise UserError(f"{what} is empty; name your files, e.g. {what}='[/data/corpus/*.jsonl.gz]'")
    out: dict[Path, None] = {}
    for pattern in patterns:
        expanded = str(Path(str(pattern)).expanduser())
        found = []
        for match in sorted(glob.glob(expanded, recursive=True)):
            path = Path(match)
            if path.is_dir():
                found += sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            elif path.is_file():
                found.append(path)
        if not found:
            raise UserError(f"{what}: {pattern} matches no file")
        out.update((p.absolute(), None) for p in found)
    return list(out)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def file_format(path: Path, declared: str) -> str:
    """text, jsonl or parquet: `declared` unless auto, else by the suffix under any compression suffix."""
    if declared not in FORMATS:
        raise UserError(f"data.format={declared} is not one of {', '.join(FORMATS)}")
    if declared != "auto":
        return declared
    name = path.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return _BY_SUFFIX.get(Path(name).suffix, "text")


class _Counted(io.RawIOBase):
    """A file's raw bytes (at most `limit` of them), counted and hashed as they are read (progress in on-disk bytes
    under any decompressor, and the source's sha256 without a second pass)."""

    def __init__(self, f: BinaryIO, limit: int | None = None) -> None:
        self.f, self.read_bytes, self.sha256, self.limit = f, 0, hashlib.sha256(), limit

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # noqa: ANN001 (a writable buffer)
        if self.limit is not None:
            buf = memoryview(buf)[: max(0, self.limit - self.read_bytes)]
        n = self.f.readinto(buf)
        if n:
            self.read_bytes += n
            self.sha256.update(memoryview(buf)[:n])
        return n

    def drain(self) -> None:
        """Read (and hash) what a decompressor left unread after its end of stream."""
        while self.f.readable() and self.readinto(bytearray(1 << 20)):
            pass

    def close(self) -> None:
        self.f.close()
        super().close()


def _open(path: Path, span: Span | None = None) -> tuple[BinaryIO, _Counted]:
    """A binary stream of the file's (decompressed) content, or of its bytes `span` (an uncompressed file), and
    the counter of its raw bytes."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the caller)
        if span is not None:
            f.seek(span[0])
        raw = _Counted(f, None if span is None else span[1] - span[0])
    except OSError as err:
        raise SourceError(f"{path}: cannot be read ({err.strerror})") from None
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BufferedReader(raw)), raw  # type: ignore[return-value]
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)), raw  # type: ignore[return-value]
    return io.BufferedReader(raw), raw  # type: ignore[return-value]


def _damaged(path: Path, err: Exception) -> SourceError:
    return SourceError(f"{path}: truncated or damaged compressed stream ({type(err).__name__}: {err})")


_STREAM_ERRORS: tuple[type[Exception], ...] = (EOFError, gzip.BadGzipFile, zlib.error, OSError)


def _stream_errors() -> tuple[type[Exception], ...]:
    try:
        import zstandard

        return (*_STREAM_ERRORS, zstandard.ZstdError)
    except ImportError:
        return _STREAM_ERRORS


def _check_head(path: Path, head: bytes) -> None:
    if not head.strip():
        raise SourceError(f"{path}: empty file (no text)")
    if b"\x00" in head[:_SNIFF]:
        raise SourceError(f"{path}: binary file (a NUL byte in its first {_SNIFF} bytes), not text")


def _no_lines() -> int:
    return 0


def _lines_before(path: Path, offset: int) -> int:
    """The lines of the file before byte `offset` (a range's first line number, counted only for an error)."""
    lines, left = 0, offset
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            lines += block.count(b"\n")
            left -= len(block)
    return lines


def _decode(path: Path, data: bytes, line: int, before: Callable[[], int] = _no_lines) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        at = before() + line + data.count(b"\n", 0, err.start)
        raise SourceError(f"{path}:{at}: invalid UTF-8 (byte {data[err.start]:#04x})") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as err:
        raise SourceError(f"{path}: cannot be read ({err.strerror})") from None
    return h.hexdigest()


def read_documents(
    path: Path, fmt: str, text_field: str, separator: str, digest: dict, span: Span | None = None
) -> Iterator[Batch]:
    """Batches of the file's documents (blank ones dropped; of its part `span` only, when given) with its on-disk
    bytes read so far and each document's place; when done, `digest["sha256"]` holds the hash of the bytes read
    (the whole file, or the byte range; a Parquet file's with its first run of row groups)."""
    kind = file_format(path, fmt)
    if kind == "parquet":
        yield from _parquet(path, text_field, span)
        if span is None or span[0] == 0:  # a file cut into row groups is hashed once, with its first run
            digest["sha256"] = sha256_file(path)
        return
    start = 0 if span is None else span[0]
    before = (lambda: _lines_before(path, start)) if start else _no_lines
    stream, raw = _open(path, span)
    errors = _stream_errors()
    try:
        with stream:
            if kind == "jsonl":
                reader = _jsonl(path, stream, text_field, start, before)
            else:
                reader = _text(path, stream, separator, start, before)
            for docs, places in reader:
                yield docs, raw.read_bytes, places
            raw.drain()
    except SourceError:
        raise
    except errors as err:
        raise _damaged(path, err) from None
    digest["sha256"] = raw.sha256.hexdigest()


def _text(path: Path, stream: BinaryIO, separator: str, start: int, before: Callable[[], int]) -> Iterator[tuple]:
    """A document per file, or the documents between `separator`s (streamed), with their byte offsets; `stream`
    begins at byte `start` of the file (a range begins just after a separator)."""
    head = stream.read(_SNIFF)
    if start == 0:
        _check_head(path, head)
    if not separator:
        data = head + stream.read()
        text = _decode(path, data, 1).replace("\r\n", "\n")
        yield ([text], [0]) if text.strip() else ([], [])
        return
    sep = separator.encode("utf-8")
    buf, at, line, docs, places, size = head, start, 1, [], [], 0
    while True:
        block = stream.read(BATCH_BYTES)
        buf += block
        parts = buf.split(sep)
        buf = parts.pop() if block else b""  # while blocks come, the last piece may continue in the next one
        for part in parts:
            text = _decode(path, part, line, before)
            line += part.count(b"\n") + sep.count(b"\n")
            if text.strip():
                docs.append(text)
                places.append(at)
                size += len(part)
            at += len(part) + len(sep)
        if size >= BATCH_BYTES or not block:
            yield docs, places
            docs, places, size = [], [], 0
        if not block:
            return


def _jsonl(path: Path, stream: BinaryIO, text_field: str, start: int, before: Callable[[], int]) -> Iterator[tuple]:
    """The `text_field` string of every JSON object line (blank lines skipped) with the line's byte offset;
    `stream` begins at byte `start` of the file (a range begins at a line)."""
    if start == 0:
        _check_head(path, stream.peek(_SNIFF)[:_SNIFF] if hasattr(stream, "peek") else b"")
    docs, places, size, at = [], [], 0, start
    for lineno, raw_line in enumerate(stream, 1):
        at += len(raw_line)
        if not raw_line.strip():
            continue
        line = _decode(path, raw_line, lineno, before)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise SourceError(f"{path}:{before() + lineno}: not a JSON line ({err.msg})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            raise SourceError(
                f"{path}:{before() + lineno}: no field {text_field!r} (set data.text_field to the text's field)"
            )
        text = obj[text_field]
        if not isinstance(text, str):
            raise SourceError(f"{path}:{before() + lineno}: field {text_field!r} is {type(text).__name__}, not text")
        if text.strip():
            docs.append(text)
            places.append(at - len(raw_line))
            size += len(raw_line)
        if size >= BATCH_BYTES:
            yield docs, places
            docs, places, size = [], [], 0
    yield docs, places


def _parquet_file(path: Path) -> object:
    """The opened Parquet file; an empty or unreadable one is one line."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install pyarrow") from None
    import pyarrow as pa

    if path.stat().st_size == 0:
        raise SourceError(f"{path}: empty file (no Parquet data)")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise SourceError(f"{path}: not a readable Parquet file ({err})") from None


def parquet_row_groups(path: Path) -> list[int]:
    """The on-disk (compressed) bytes of each row group of a Parquet file, from its footer."""
    md = _parquet_file(path).metadata
    groups = [md.row_group(g) for g in range(md.num_row_groups)]
    return [sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)) for rg in groups]


def _parquet(path: Path, column: str, span: Span | None) -> Iterator[Batch]:
    """The `column` strings of a Parquet file (of its row groups `span` only, when given), a record batch at a time,
    with their row numbers; bytes are pro rata of the rows read."""
    import pyarrow as pa

    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise SourceError(f"{path}: no column {column!r} (it has {', '.join(names)}); set data.text_field")
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise SourceError(f"{path}: column {column!r} is {kind}, not text")
    md = pf.metadata
    groups = list(range(md.num_row_groups) if span is None else range(*span))
    size = path.stat().st_size if span is None else sum(parquet_row_groups(path)[g] for g in groups)
    first = sum(md.row_group(g).num_rows for g in range(groups[0])) if groups else 0
    rows, done = max(1, sum(md.row_group(g).num_rows for g in groups)), 0
    try:
        for batch in pf.iter_batches(columns=[column], batch_size=1024, row_groups=None if span is None else groups):
            values = batch.column(0).to_pylist()
            bad = next((i for i, v in enumerate(values) if v is None), None)
            if bad is not None:
                raise SourceError(f"{path}: row {first + done + bad}: column {column!r} is null")
            kept = [i for i, v in enumerate(values) if v.strip()]
            yield [values[i] for i in kept], size * (done + len(values)) // rows, [first + done + i for i in kept]
            done += len(values)
    except pa.ArrowException as err:
        raise SourceError(f"{path}: row {first + done}: cannot be read ({err})") from None
