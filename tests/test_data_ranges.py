"""One large file cut into units of work (issue 53): a part of a JSON Lines or separated text file read alone yields
exactly what a reading of the whole file gives it; one file prepared in parts on one worker or two, or whole, gives
the same tokens in the same order and the same train/val split by document; a bad line in a later part names its
line in the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncpipe.config.schema import DataConfig, TokenizerConfig
from asyncpipe.data import load_manifest, prepare
from asyncpipe.data.dataset import split_files
from asyncpipe.data.ranges import byte_spans
from asyncpipe.data.sources import read_documents
from asyncpipe.errors import UserError
from asyncpipe.track.files import changes_no_result

WORDS = "the of and to a in that is was he for it with as his on be at by été 日本".split()


def cfgs(root: Path, **data_kw):
    d = OmegaConf.structured(DataConfig(name="files", root=str(root), **data_kw))
    return d, OmegaConf.structured(TokenizerConfig(name="byte", vocab_size=256))


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def words(rng: np.random.Generator, n: int, newlines: bool = False) -> str:
    """n random words; with `newlines`, some joined by runs of 1 to 5 newlines (a separator like "\\n\\n" overlaps
    itself in a run of three)."""
    gaps = [("\n" * int(rng.integers(1, 6)) if newlines and rng.random() < 0.15 else " ") for _ in range(n)]
    return "".join(w + g for w, g in zip(rng.choice(WORDS, n), gaps))


def read(path: Path, sep: str, span: tuple[int, int] | None) -> tuple[list[str], list[int]]:
    docs, places = [], []
    for batch, _, where in read_documents(path, "auto", "text", sep, {}, span):
        docs += batch
        places += where
    return docs, places


@pytest.mark.parametrize("sep", ["", "\n\n", "\n\n\n", "<|endoftext|>"])
def test_parts_read_as_the_whole_file(tmp_path, sep):
    """Cut anywhere (ranges of 97 bytes to a third of the file), the parts' documents and their byte offsets, in
    order, are the whole file's: a JSON Lines file (sep "") with blank lines, and texts with separators that overlap
    themselves in runs of newlines, and empty documents between two separators."""
    rng = np.random.default_rng(len(sep))
    if sep:
        path = tmp_path / "x.txt"
        pieces = [words(rng, int(rng.integers(1, 80)), newlines=True) for _ in range(400)]
        path.write_text("".join(p + (sep * 2 if rng.random() < 0.05 else sep) for p in pieces))
    else:
        path = tmp_path / "x.jsonl"
        lines = [json.dumps({"text": words(rng, int(rng.integers(1, 80)), newlines=True)}) for _ in range(400)]
        path.write_text("".join(line + ("\n\n" if rng.random() < 0.05 else "\n") for line in lines))
    size = path.stat().st_size
    whole = read(path, sep, None)
    assert len(whole[0]) > 300
    for range_bytes in (97, 1000, 4096, size / 3):
        spans = byte_spans(path, size, range_bytes, sep)
        assert len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))
        parts = [read(path, sep, s) for s in spans]
        assert (sum((p[0] for p in parts), []), sum((p[1] for p in parts), [])) == whole, range_bytes


def write_corpus(folder: Path, kind: str, docs: list[str]) -> tuple[Path, dict]:
    """One file of `docs`: JSON Lines, text with a separator, or Parquet in row groups of 50."""
    if kind == "jsonl":
        path = folder / "big.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        return path, {"separator": "\n===\n"}  # read by text only: a JSON Lines file is cut at its lines
    if kind == "text":
        path = folder / "big.txt"
        path.write_text("\n===\n".join(docs))
        return path, {"separator": "\n===\n"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "big.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=50)
    return path, {}


def split_docs(path: Path, split: str, docs: list[str]) -> list[int]:
    """The numbers of the documents a prepared split holds, in order, after checking that its bytes are exactly
    those documents, whole, one after the other."""
    m = load_manifest(path)
    ids = np.concatenate([np.fromfile(path / f, dtype=m["dtype"]) for f in split_files(m, split)])
    text = ids.astype(np.uint8).tobytes().decode()  # byte tokens: the ids are the text's bytes
    numbers = [int(n) for n in re.findall(r"<(\d{5})>", text)]
    assert text == "".join(docs[i] for i in numbers)
    return numbers


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet"])
def test_one_file_in_parts_gives_the_same_tokens_on_any_workers_and_shard_size(tmp_path, kind):
    """Parts of ~20 KB prepared by one worker and by two give the same files; prepared whole (data.shard_mb=100),
    the same tokens in the same order and the same documents in each split; neither setting changes a result."""
    rng = np.random.default_rng(0)
    docs = [f"<{i:05d}> {words(rng, int(rng.integers(5, 60)))}\n" for i in range(1500)]
    path, kw = write_corpus(tmp_path, kind, docs)
    one = prepare(*cfgs(tmp_path / "one", paths=[str(path)], shard_mb=0.02, **kw))
    two = prepare(*cfgs(tmp_path / "two", paths=[str(path)], shard_mb=0.02, workers=2, **kw))
    whole = prepare(*cfgs(tmp_path / "whole", paths=[str(path)], shard_mb=100, **kw))
    assert one.name == two.name == whole.name and tree(one) == tree(two)
    m, m_whole = load_manifest(one, verify_hashes=True), load_manifest(whole)
    assert len(m["shards"]["train"]) > 3 and len(m_whole["shards"]["train"]) == 1
    assert [s["name"] for s in m["sources"]] == [path.name] * len(m["sources"]) and all("span" in s for s in m["sources"])
    assert sum(s["documents"] for s in m["sources"]) == len(docs)
    for split in ("train", "val"):
        cat = [b"".join((p / f).read_bytes() for f in split_files(load_manifest(p), split)) for p in (one, whole)]
        assert cat[0] == cat[1]
    train, val = split_docs(one, "train", docs), split_docs(one, "val", docs)
    assert sorted(train + val) == list(range(len(docs))) and 50 < len(val) < 300
    assert changes_no_result("data.shard_mb") and changes_no_result("data.workers")


def test_a_bad_line_in_a_later_part_names_its_line_in_the_file(tmp_path):
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": words(rng, 40)}) for _ in range(3000)]
    lines[2500] = json.dumps({"body": "no text here"})
    (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"x\.jsonl:2501: no field 'text'"):
        prepare(*cfgs(tmp_path / "root", paths=[str(tmp_path / "x.jsonl")], shard_mb=0.02))
    text = "\n\n".join(words(rng, 40) for _ in range(3000)).encode()
    bad = text.index(b"\n\n", len(text) * 9 // 10) + 3  # inside the document after a separator, late in the file
    (tmp_path / "y.txt").write_bytes(text[:bad] + b"\xff" + text[bad:])
    line = text[:bad].count(b"\n") + 1
    with pytest.raises(UserError, match=rf"y\.txt:{line}: invalid UTF-8"):
        prepare(*cfgs(tmp_path / "root", paths=[str(tmp_path / "y.txt")], separator="\n\n", shard_mb=0.02))
    assert [p.name for p in (tmp_path / "root").iterdir() if not p.name.endswith(".lock")] == []
