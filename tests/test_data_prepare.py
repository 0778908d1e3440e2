"""Streamed preparation (issue 53): token ids made elsewhere (`data=tokens`), a preparation killed midway and run
again ending with the same files as an uninterrupted one, and each bad input one line naming the file (and its
line or row) with nothing half-written left in the data root."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncpipe.config.schema import DataConfig, TokenizerConfig
from asyncpipe.data import MicroBatches, dataset_dir, load_manifest, prepare
from asyncpipe.data.dataset import split_files
from asyncpipe.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def cfgs(root: Path, data: str = "files", tok: str = "byte", vocab: int = 256, **data_kw):
    d = OmegaConf.structured(DataConfig(name=data, root=str(root), **data_kw))
    t = OmegaConf.structured(TokenizerConfig(name=tok, vocab_size=vocab))
    return d, t


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- data=tokens ---------------------------------------------------------------------------------


def nano_ids(n_docs: int, eot: int, vocab: int, seed: int = 0) -> np.ndarray:
    """nanoGPT-style ids: documents of random length, each followed by the end-of-text id."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, eot, rng.integers(5, 300)), eot) for _ in range(n_docs)]
    return np.concatenate(docs).astype(np.uint16 if vocab <= 2**16 else np.uint32)


def test_tokens_bin_and_npy_split_by_document(tmp_path):
    ids = nano_ids(400, 50256, 50257)
    ids[:1000].tofile(tmp_path / "a.bin")  # a document runs on into the next file
    np.save(tmp_path / "b.npy", ids[1000:].astype(np.int64))
    path = prepare(*cfgs(tmp_path / "root", data="tokens", tok="gpt2", vocab=50257,
                         paths=[str(tmp_path / "a.bin"), str(tmp_path / "b.npy")]))
    m = load_manifest(path, verify_hashes=True)
    assert m["dtype"] == "uint16" and m["tokens"]["train"] + m["tokens"]["val"] == len(ids)
    got = {s: np.concatenate([np.fromfile(path / f, dtype=m["dtype"]) for f in split_files(m, s)]) for s in m["shards"]}
    # each file's documents end at an end-of-text id; a file's last piece is one document of its own
    assert m["documents"]["train"] + m["documents"]["val"] == int((ids == 50256).sum()) + 1
    assert sorted(np.concatenate(list(got.values())).tolist()) == sorted(ids.tolist())
    assert all(int(got[s][-1]) == 50256 for s in got) and m["documents"]["val"] > 10
    # without an end-of-text id (tokenizer=ids): fixed blocks of ids
    ids.tofile(tmp_path / "all.bin")
    path = prepare(*cfgs(tmp_path / "root", data="tokens", tok="ids", vocab=50257, paths=[str(tmp_path / "all.bin")]))
    m = load_manifest(path)
    assert m["documents"]["train"] + m["documents"]["val"] == -(-len(ids) // 2048)
    assert m["tokenizer"] == {"name": "ids", "vocab_size": 50257, "eot_id": None}
    MicroBatches(path, "val", seq_len=64, micro_batch_size=2, seed=0).get(0)


# --- a killed preparation, run again ---------------------------------------------------------------------


def killed_midway(cmd: list[str], root: Path, env: dict) -> list[str]:
    """Run `cmd` (a preparation into data root `root`) and SIGKILL it once its first shard is done; the finished
    shards' records it left."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(root.glob(".*.partial/shard-00000.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (partial,) = root.glob(".*.partial")
    return sorted(p.name for p in partial.glob("shard-*.json"))


def resumes_to_identical_files(args: list[str], tmp_path: Path, shards: int) -> None:
    """An uninterrupted two-worker preparation; the same killed midway (one worker) and run again: the re-run keeps
    the finished shards, redoes the rest and ends with the same files."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "asyncpipe", *args]
    ref = subprocess.run([*cmd, f"data.root={tmp_path}/ref", "data.workers=2"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    root = tmp_path / "killed"
    done = killed_midway([*cmd, f"data.root={root}"], root, env)
    assert 1 <= len(done) < shards, done  # killed midway
    assert not list(root.glob("files-*"))  # no dataset until it is whole
    again = subprocess.run([*cmd, f"data.root={root}"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{len(done)} kept from an interrupted run" in again.stderr
    (ref_dir,) = (tmp_path / "ref").glob("files-*")
    (new_dir,) = root.glob("files-*")
    assert ref_dir.name == new_dir.name and tree(ref_dir) == tree(new_dir)
    assert not list(root.glob(".*.partial"))
    assert len(load_manifest(new_dir, verify_hashes=True)["shards"]["train"]) == shards


def test_killed_preparation_resumes_to_identical_files(tmp_path):
    """SIGKILL `asyncpipe data prepare` once its first shard is done; the re-run ends with the files of an
    uninterrupted run (which used two workers: workers change no byte)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = np.array("the of and to a in that is was he for it with as his on be at by".split())
    for i in range(40):  # 40 files of ~150 KB, a shard each
        with gzip.open(corpus / f"part{i:02d}.jsonl.gz", "wt") as f:
            for _ in range(120):
                f.write(json.dumps({"text": " ".join(rng.choice(words, 250))}) + "\n")
    args = ["data", "prepare", "data=files", f"data.paths=[{corpus}/*.jsonl.gz]", "data.shard_mb=0.0001"]
    resumes_to_identical_files(args, tmp_path, 40)


def test_one_large_file_killed_midway_resumes_to_identical_files(tmp_path):
    """One JSON Lines file cut into 40 byte ranges by data.shard_mb: a range is a unit of work and of resuming."""
    rng = np.random.default_rng(1)
    words = np.array("the of and to a in that is was he for it with as his on be at by".split())
    big = tmp_path / "corpus" / "big.jsonl"
    big.parent.mkdir()
    with open(big, "w") as f:
        for _ in range(40 * 120):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 250))}) + "\n")
    args = ["data", "prepare", "data=files", f"data.paths=[{big}]", f"data.shard_mb={big.stat().st_size / 40.5e6}"]
    resumes_to_identical_files(args, tmp_path, 40)


# --- bad input: one line naming the file, nothing half-written -------------------------------------------------


def _write(name: str, data: bytes):
    def setup(folder: Path) -> None:
        (folder / name).write_bytes(data)

    return setup


def _parquet_without_text(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a document"] * 30}), folder / "x.parquet")


def _truncated_gz(folder: Path) -> None:
    lines = "".join(json.dumps({"text": str(n)}) + "\n" for n in np.random.default_rng(0).random(2000))
    data = gzip.compress(lines.encode())
    (folder / "x.jsonl.gz").write_bytes(data[: len(data) // 2])


BAD = {
    "empty file": (_write("x.txt", b""), {}, "x.txt: empty file"),
    "binary file": (_write("x.txt", b"\x7fELF\x00\x01\x02" * 100), {}, "x.txt: binary file"),
    "invalid UTF-8": (_write("x.txt", b"line one\nline two\nthree \xff\xfe here\n"), {}, "x.txt:3: invalid UTF-8"),
    "invalid UTF-8, separated": (_write("x.txt", b"a\n\nb\n\nc\xc3(\n"), {"separator": "\n\n"}, "x.txt:5: invalid UTF-8"),
    "JSON line without the field": (_write("x.jsonl", b'{"text": "a"}\n{"body": "b"}\n'), {}, "x.jsonl:2: no field 'text'"),
    "JSON line not JSON": (_write("x.jsonl", b'{"text": "a"}\n\n{"text": \n'), {}, "x.jsonl:3: not a JSON line"),
    "Parquet without the column": (_parquet_without_text, {}, "x.parquet: no column 'text' (it has body)"),
    "not Parquet": (_write("x.parquet", b"PAR1 not really"), {}, "x.parquet: not a readable Parquet file"),
    "truncated gzip": (_truncated_gz, {}, "x.jsonl.gz: truncated or damaged compressed stream"),
    "glob matching nothing": (lambda folder: None, {"paths": ["{folder}/*.jsonl"]}, "/*.jsonl matches no file"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_naming_the_file(name, tmp_path):
    setup, kw, needle = BAD[name]
    folder = tmp_path / "in"
    folder.mkdir()
    setup(folder)
    kw = {"paths": [str(folder)], **kw}
    kw["paths"] = [p.replace("{folder}", str(folder)) for p in kw["paths"]]
    root = tmp_path / "root"
    with pytest.raises(UserError) as err:
        prepare(*cfgs(root, **kw))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(folder) in str(err.value)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == [] if root.exists() else True


@pytest.mark.parametrize("case", ["beyond the vocabulary", "truncated .bin", "not an .npy"])
def test_bad_token_files(case, tmp_path):
    file = tmp_path / ("x.npy" if case == "not an .npy" else "x.bin")
    ids = np.arange(0, 300, dtype=np.uint16)
    if case == "beyond the vocabulary":
        ids.tofile(file)
        needle = "x.bin: token id 256 at position 256 is beyond the vocabulary (256 ids"
    elif case == "truncated .bin":
        file.write_bytes(ids.tobytes()[:-1])
        needle = "x.bin: 599 bytes is not a whole number of uint16 ids"
    else:
        file.write_bytes(b"\x93NUMPY garbage")
        needle = "x.npy: unreadable or truncated token file"
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        prepare(*cfgs(tmp_path / "root", data="tokens", tok="ids", vocab=256, paths=[str(file)]))
    assert not list((tmp_path / "root").glob("tokens-*")) and not list((tmp_path / "root").glob(".*.partial"))


def test_damaged_prepared_shard_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n" * 50)
    (tmp_path / "b.txt").write_text("second document\n" * 50)
    (tmp_path / "c.txt").write_text("third document\n" * 50)
    d, t = cfgs(tmp_path / "root", paths=[str(tmp_path / "*.txt")], val_fraction=0.4, shard_mb=1e-6)
    path = prepare(d, t)
    shard = path / load_manifest(path)["shards"]["train"][0]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(UserError, match=f"token file {shard} has .* bytes, the manifest says"):
        MicroBatches(path, "train", 8, 1, 0)
    shard.unlink()
    with pytest.raises(UserError, match=f"token file {shard} is missing"):
        load_manifest(path)
    assert dataset_dir(d, t) == path


def test_hf_dataset_refusals(tmp_path):
    """A split or column the dataset lacks, and (offline, in a fresh interpreter) a name not in the cache: one line."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a", "b"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"data.dataset=.*dd has no split 'validation' \(it has train\)"):
        prepare(*cfgs(tmp_path / "root", data="hf", dataset=str(tmp_path / "dd"), split="validation"))
    with pytest.raises(UserError, match=r"no column 'text' \(it has body\); set data.text_field"):
        prepare(*cfgs(tmp_path / "root", data="hf", dataset=str(tmp_path / "dd")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-m", "asyncpipe", "data", "prepare", "data=hf", "data.dataset=nobody/none",
                          f"data.root={tmp_path}/root"], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: data.dataset=nobody/none: cannot be loaded (") and "Offline" in lines[0]
    assert [p.name for p in (tmp_path / "root").iterdir() if not p.name.endswith(".lock")] == []
