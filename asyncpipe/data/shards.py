"""One shard of a streamed preparation: its units (files, parts of a large file, or a dataset's row ranges) read a
batch at a time, tokenized, each document sent to train or val by a hash of (split seed, file, the document's
place in the file), written as `train-NNNNN.bin` / `val-NNNNN.bin`, and recorded last in `shard-NNNNN.json` (a
shard is done when that exists).

A shard's files depend on its units and settings only, never on the worker, the order or an earlier killed
attempt, so a resumed preparation ends with the same bytes as an uninterrupted one; and a document's split
depends on its place in its file only, so the split's tokens, in order, are the same however files are cut.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from asyncpipe.data.idsources import open_dataset, read_ids, read_rows
from asyncpipe.data.sources import read_documents, sha256_file

SPLITS = ("train", "val")
# What places a document for the split (recorded in what a dataset is built from, so another is another directory):
# 2: its byte offset in a JSON Lines or text file, its row in a Parquet file or a dataset, its index in a token file.
SPLIT_KEYS = 2


@dataclass(frozen=True)
class Unit:
    name: str  # a file's path relative to the corpus's common folder (the split's key), or "rows" of a dataset
    path: str = ""  # the file read (files, tokens)
    span: tuple[int, int] | None = None  # the part read: bytes or Parquet row groups of a file, a dataset's rows
    bytes: int = 0  # input bytes (progress and shard sizes)

    @property
    def label(self) -> str:
        """The unit as plan.json names it: the file, or the file and its part."""
        return self.name if self.span is None else f"{self.name} [{self.span[0]}, {self.span[1]})"


@dataclass(frozen=True)
class ShardJob:
    index: int
    units: tuple[Unit, ...]
    source: dict  # kind (files, tokens, hf) and its reading settings
    tokenizer: dict  # name, path, eot, vocab_size: rebuilt in the worker
    split: dict  # seed, val_fraction
    dtype: str  # of the written ids
    work: str  # the directory shards are written into
    extra: dict = field(default_factory=dict)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def meta_name(index: int) -> str:
    return f"shard-{index:05d}.json"


_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def in_val(seed: int, unit: str, places: np.ndarray, val_fraction: float) -> np.ndarray:
    """Whether the documents at `places` of file `unit` go to val: a splitmix64 hash of (seed, unit, place) below
    the fraction, so the split is by document, deterministic, and the same however the corpus is sharded or read."""
    key = int.from_bytes(hashlib.sha256(f"{seed}\0{unit}".encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        x = np.asarray(places, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(spec: dict) -> Any:
    """This process's tokenizer for `spec`, built once (a worker serves many shards)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _TOKENIZERS:
        from omegaconf import OmegaConf

        from asyncpipe.data.tokenizer import text_tokenizer

        _TOKENIZERS[key] = text_tokenizer(OmegaConf.create(spec))
    return _TOKENIZERS[key]


def encode(tok: Any, docs: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids in one flat array (an end-of-text id after each when the tokenizer has one) and each
    document's length in it. Id arrays (data=tokens) are taken as they are."""
    if docs and isinstance(docs[0], np.ndarray):
        lengths = np.fromiter(map(len, docs), np.int64, len(docs))
        return np.concatenate(docs).astype(dtype, copy=False), lengths
    if tok.name == "byte":  # the bytes are the ids
        raw = [d.encode("utf-8") for d in docs]
        lengths = np.fromiter(map(len, raw), np.int64, len(raw))
        return np.frombuffer(b"".join(raw), np.uint8).astype(dtype), lengths
    lists = tok.encode_batch(docs)
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype, count=int(lengths.sum()))
    if tok.eot_id is not None:
        flat = np.insert(flat, np.cumsum(lengths), tok.eot_id)
        lengths += 1
    return flat, lengths


class _SplitFile:
    """One split's token file of a shard, written under a temporary name and hashed as it is written."""

    def __init__(self, path: Path, itemsize: int) -> None:
        self.path, self.tmp, self.itemsize = path, path.with_name(path.name + ".part"), itemsize
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish)
        self.sha256, self.tokens, self.documents = hashlib.sha256(), 0, 0

    def write(self, ids: np.ndarray, documents: int) -> None:
        data = ids.tobytes()
        self.f.write(data)
        self.sha256.update(data)
        self.tokens += len(ids)
        self.documents += documents

    def finish(self) -> dict | None:
        """Made durable and given its name; None (and no file) when the split got no document here."""
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.tokens == 0:
            self.tmp.unlink()
            return None
        os.replace(self.tmp, self.path)
        return {
            "file": self.path.name,
            "tokens": self.tokens,
            "bytes": self.tokens * self.itemsize,
            "sha256": self.sha256.hexdigest(),
        }


def _batches(job: ShardJob, unit: Unit, tok: Any, digest: dict) -> Iterator[tuple[list, int, list | None]]:
    """The unit's documents in batches, with the unit's input bytes read so far and the documents' places in their
    file (None: their index in it, counted by the caller)."""
    src = job.source
    if src["kind"] == "files":
        path = Path(unit.path)
        yield from read_documents(path, src["format"], src["text_field"], src["separator"], digest, unit.span)
    elif src["kind"] == "tokens":
        eot = None if tok is None else tok.eot_id
        for docs, read in read_ids(Path(unit.path), src["token_dtype"], int(job.tokenizer["vocab_size"]), eot):
            yield docs, read, None
        digest["sha256"] = sha256_file(Path(unit.path))
    else:
        ds = open_dataset(src["dataset"], src["subset"], src["split"], src["text_field"])
        first, stop = unit.span or (0, 0)
        rows, at = max(1, stop - first), first
        for docs, done in read_rows(ds, first, stop, src["text_field"]):
            kept = [i for i, d in enumerate(docs) if d.strip()]
            yield [docs[i] for i in kept], unit.bytes * done // rows, [at + i for i in kept]
            at = first + done


def run_shard(job: ShardJob, report: Callable[[int], None]) -> dict:
    """Write shard `job.index` and its record; `report(n)` is called with input bytes as they are read."""
    work = Path(job.work)
    tok = _tokenizer(job.tokenizer) if job.tokenizer["name"] != "ids" else None
    dtype = np.dtype(job.dtype).newbyteorder("<")
    outs = {s: _SplitFile(work / shard_name(s, job.index), dtype.itemsize) for s in SPLITS}
    sources = []
    for unit in job.units:
        digest: dict = {}
        done, n_docs = 0, 0
        for docs, read, places in _batches(job, unit, tok, digest):
            if docs:
                flat, lengths = encode(tok, docs, dtype)
                keys = np.arange(n_docs, n_docs + len(docs)) if places is None else np.asarray(places)
                val = in_val(job.split["seed"], unit.name, keys, job.split["val_fraction"])
                mask = np.repeat(val, lengths)
                outs["train"].write(flat[~mask], int((~val).sum()))
                outs["val"].write(flat[mask], int(val.sum()))
                n_docs += len(docs)
            report(read - done)
            done = read
        entry = {"name": unit.name, "bytes": unit.bytes, "documents": n_docs}
        if unit.span is not None:
            entry["span"] = list(unit.span)
        if "sha256" in digest:
            entry["sha256"] = digest["sha256"]
        sources.append(entry)
    files = {s: outs[s].finish() for s in SPLITS}
    record = {
        "index": job.index,
        "files": files,
        "sources": sources,
        "documents": {s: outs[s].documents for s in SPLITS},
    }
    _write_json(work / meta_name(job.index), record)
    return record


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON so that a reader sees the whole file or none (temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
