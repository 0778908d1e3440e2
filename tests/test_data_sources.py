"""Your own corpus and tokenizer (issue 53): a tokenizer.json trained here (`tokenizer=hf`), corpora of each kind
(text, JSON Lines, Parquet, a `datasets` dataset saved to disk, .bin / .npy ids) prepared into shards, read back
document by document, trained on for a few steps through the CLI; and a bad input is one line naming the file."""

from __future__ import annotations

import functools
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncpipe.cli import main
from asyncpipe.config import compose
from asyncpipe.config.schema import DataConfig, TokenizerConfig
from asyncpipe.data import MicroBatches, get_tokenizer, load_manifest, prepare
from asyncpipe.data.corpus import load_hamlet
from asyncpipe.data.dataset import split_files
from asyncpipe.errors import ConfigError, UserError

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """Hamlet's paragraphs (~1,400 documents): enough that a 10 % val split is never empty."""
    return [p.strip("\n") + "\n" for d in load_hamlet().documents for p in d.split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory, docs) -> Path:
    """A byte-level BPE tokenizer.json trained here with `tokenizers` (600 ids, id 0 the end-of-text token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def cfgs(root: Path, tok_file: Path, data: str = "files", **data_kw):
    d = OmegaConf.structured(DataConfig(name=data, root=str(root), **data_kw))
    t = OmegaConf.structured(TokenizerConfig(name="hf", path=str(tok_file), vocab_size=600))
    return d, t


def read_docs(path: Path, split: str) -> list[str]:
    """A prepared split decoded back into its documents (cut at each end-of-text id)."""
    m = load_manifest(path)
    ids = np.concatenate([np.fromfile(path / f, dtype=m["dtype"]) for f in split_files(m, split)])
    eot = m["tokenizer"]["eot_id"]
    tok = get_tokenizer(path)
    pieces = np.split(ids, np.flatnonzero(ids == eot) + 1)
    assert len(pieces[-1]) == 0, "every document ends with the end-of-text id"
    return [tok.decode(p[:-1].tolist()) for p in pieces[:-1]]


# --- tokenizer=hf -----------------------------------------------------------------------------------


def test_hf_tokenizer_vocab_and_eot_come_from_the_file(tok_file, tmp_path):
    from tokenizers import Tokenizer

    cfg = compose(["tokenizer=hf", f"tokenizer.path={tok_file}", "model=tiny"])
    assert cfg.tokenizer.vocab_size == Tokenizer.from_file(str(tok_file)).get_vocab_size() == 600
    with pytest.raises(ConfigError, match="tokenizer=hf needs tokenizer.path"):
        compose(["tokenizer=hf"])
    with pytest.raises(ConfigError, match=f"tokenizer.path {tmp_path}/none.json is not a file"):
        compose(["tokenizer=hf", f"tokenizer.path={tmp_path}/none.json"])
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        compose(["tokenizer=hf", f"tokenizer.path={tmp_path}/bad.json"])
    d, t = cfgs(tmp_path, tok_file, data="hamlet")
    t.vocab_size = 512
    with pytest.raises(UserError, match="tokenizer.vocab_size=512 disagrees with .*'s 600 ids"):
        prepare(d, t)
    t.vocab_size, t.eot = 600, "<nope>"
    with pytest.raises(UserError, match="tokenizer.eot='<nope>' is not a token"):
        prepare(d, t)


def test_a_model_whose_vocab_is_smaller_than_the_files_is_one_line(tok_file, tmp_path, capsys):
    """The model's vocabulary follows the file (model.vocab_size=null); a preset's smaller one is refused."""
    from asyncpipe.runtime.device import vocab_size_for

    d, t = cfgs(tmp_path, tok_file, data="hamlet")
    manifest = load_manifest(prepare(d, t))
    assert manifest["tokenizer"] == {"name": "hf", "vocab_size": 600, "eot_id": 0, "file": "tokenizer.json",
                                     "sha256": manifest["tokenizer"]["sha256"]}
    assert vocab_size_for(OmegaConf.create({"vocab_size": None}), manifest) == 600
    with pytest.raises(UserError, match="model.vocab_size=512 is smaller than the tokenizer's 600 ids"):
        vocab_size_for(OmegaConf.create({"vocab_size": 512}), manifest)


# --- sources, each kind ----------------------------------------------------------------------------


def write_text_files(folder: Path, docs: list[str]) -> tuple[list[str], dict]:
    for i, doc in enumerate(docs[:300]):
        (folder / f"doc{i:03d}.txt").write_text(doc)
    return [str(folder / "*.txt")], {}


def write_separated_gz(folder: Path, docs: list[str]) -> tuple[list[str], dict]:
    with gzip.open(folder / "all.txt.gz", "wt") as f:
        f.write("\n===\n".join(d.rstrip("\n") for d in docs))
    return [str(folder / "all.txt.gz")], {"separator": "\n===\n"}


def write_jsonl_zst(folder: Path, docs: list[str]) -> tuple[list[str], dict]:
    import zstandard

    lines = "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs))
    half = len(docs) // 2
    (folder / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines[: lines.index(f'{{"id": {half},')].encode()))
    (folder / "b.jsonl").write_text(lines[lines.index(f'{{"id": {half},'):])
    return [str(folder / "*.jsonl*")], {"text_field": "body"}


def write_parquet(folder: Path, docs: list[str]) -> tuple[list[str], dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(3):
        part = docs[k::3]
        pq.write_table(pa.table({"url": [f"u{i}" for i in range(len(part))], "text": part}),
                       folder / f"part-{k}.parquet", row_group_size=200)
    return [str(folder)], {}


def write_hf_dataset(folder: Path, docs: list[str]) -> tuple[list[str], dict]:
    import datasets

    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(folder / "saved"))
    return [], {"dataset": str(folder / "saved"), "text_field": "content"}


KINDS = {"text": write_text_files, "text-separated.gz": write_separated_gz, "jsonl.zst": write_jsonl_zst,
         "parquet": write_parquet, "hf": write_hf_dataset}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs, tok_file) -> dict[str, tuple[Path, list[str]]]:
    """Each kind of corpus written and prepared once: kind -> (dataset dir, its documents)."""
    root = tmp_path_factory.mktemp("root")
    out = {}
    for kind, write in KINDS.items():
        folder = tmp_path_factory.mktemp(kind)
        paths, kw = write(folder, docs)
        d, t = cfgs(root, tok_file, data="hf" if kind == "hf" else "files", paths=paths, **kw)
        expected = {"text": docs[:300], "text-separated.gz": [doc.rstrip("\n") for doc in docs]}.get(kind, docs)
        out[kind] = (prepare(d, t), expected)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_prepares_every_document_whole_in_one_split(prepared, kind, tok_file):
    path, docs = prepared[kind]
    m = load_manifest(path, verify_hashes=True)
    assert m["format"] == 2 and m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 600
    train, val = read_docs(path, "train"), read_docs(path, "val")
    assert (len(train), len(val)) == (m["documents"]["train"], m["documents"]["val"])
    assert sorted(train + val) == sorted(docs) and val and len(val) < 0.2 * len(docs)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    assert m["tokens"]["train"] + m["tokens"]["val"] == sum(len(e.ids) + 1 for e in tok.encode_batch(docs))
    assert m["sources"] and all(s.get("documents", 1) > 0 and len(s["sha256"]) == 64 for s in m["sources"])
    if kind == "hf":  # the dataset's Arrow files
        assert [s["name"] for s in m["sources"]] == [p.name for p in sorted(Path(m["config"]["dataset"]).glob("*.arrow"))]
    else:  # every source file is hashed as read
        import hashlib

        for src in m["sources"]:
            file = next(Path(p) for p in map(str, Path(m["config"]["paths"][0]).parent.rglob("*")) if p.endswith(src["name"]))
            assert src["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()


def test_shards_and_workers_change_no_token(tmp_path, docs, tok_file):
    """The split is by a hash of (seed, file, the document's place in it): one shard in this process, and on two
    worker processes a shard for the compressed file and one per ~20 KB part of the other, write the same tokens in
    the same order; so neither setting is one that can change a result."""
    from asyncpipe.track.files import changes_no_result

    paths, kw = write_jsonl_zst(tmp_path, docs)
    one = prepare(*cfgs(tmp_path / "one", tok_file, paths=paths, **kw))
    two = prepare(*cfgs(tmp_path / "two", tok_file, paths=paths, workers=2, shard_mb=0.02, **kw))
    m1, m2 = load_manifest(one), load_manifest(two)
    assert len(m1["shards"]["train"]) == 1 and len(m2["shards"]["train"]) > 3
    assert sum("span" in s for s in m2["sources"]) == len(m2["shards"]["train"]) - 1  # b.jsonl's parts
    assert changes_no_result("data.shard_mb") and changes_no_result("data.workers")
    for split in ("train", "val"):
        cat = [b"".join((p / f).read_bytes() for f in split_files(m, split)) for p, m in ((one, m1), (two, m2))]
        assert cat[0] == cat[1]
    assert m1["tokenizer"]["sha256"] == m1["config"]["tokenizer"]["sha256"]


def test_micro_batches_read_across_shards(tmp_path, docs, tok_file):
    paths, kw = write_text_files(tmp_path, docs)
    path = prepare(*cfgs(tmp_path / "root", tok_file, paths=paths, shard_mb=0.002, **kw))
    m = load_manifest(path)
    assert len(m["shards"]["train"]) > 5
    flat = np.concatenate([np.fromfile(path / f, dtype=m["dtype"]) for f in split_files(m, "train")])
    mb = MicroBatches(path, "train", seq_len=200, micro_batch_size=8, seed=3)
    assert mb.n_tokens == len(flat)
    for i in range(20):
        x, y = mb.get(i)
        for row, off in enumerate(mb.offsets(i)):
            assert x[row].tolist() == flat[off : off + 200].tolist() and int(y[row, -1]) == flat[off + 200]


@pytest.mark.parametrize("kind", list(KINDS))
def test_train_a_few_steps_on_each_kind(prepared, kind, docs, tok_file, tmp_path, monkeypatch):
    """`asyncpipe train` on the prepared dataset (found, not rebuilt): the tiny model, 3 steps, its epochs."""
    path, _ = prepared[kind]
    m = load_manifest(path)
    cfg = m["config"]
    args = [f"data={cfg['data']}", f"data.root={path.parent}", "tokenizer=hf", f"tokenizer.path={tok_file}"]
    args += [f"data.paths=[{','.join(cfg['paths'])}]"] if cfg["paths"] else [f"data.dataset={cfg['dataset']}"]
    args += [f"data.{k}={cfg[k]}" for k in ("text_field",) if cfg[k] != "text"]
    if cfg["separator"]:
        args.append(f"data.separator='{cfg['separator']}'")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    stamp = (path / "manifest.json").stat().st_mtime_ns
    with pytest.raises(SystemExit) as done:
        main(["train", "model=tiny", *args, "train.steps=3", "train.eval_every=3", "train.eval_batches=1",
              "tracker.wandb.mode=disabled", f"run.dir={tmp_path}/run"])
    assert done.value.code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["tokens"] == 3 * 4 * 8 * 64
    assert summary["epochs"] == pytest.approx(summary["tokens"] / m["tokens"]["train"])
    assert (path / "manifest.json").stat().st_mtime_ns == stamp  # prepared once, reused


# What load_dataset("tester/tiny_corpus") leaves in the cache for a hub repo of Parquet files: the Parquet
# builder's Arrow files and dataset_info.json under HF_HOME/datasets/{namespace}___{name}/{config}/{version}/{commit}
# (`DatasetBuilder._relative_data_dir`). Made here from a local file, nothing downloaded: a builder given a repo id
# refuses local data files, so it is built under the bare name and its directory given the namespaced one.
POPULATE = """
import sys
from pathlib import Path

import datasets.config
from datasets.packaged_modules.parquet.parquet import Parquet

files = {"train": [sys.argv[1]]}  # the repo's default config, as its README would declare it
Parquet(dataset_name="tiny_corpus", config_id="default", hash="0" * 40, data_files=files).download_and_prepare()
cache = Path(datasets.config.HF_DATASETS_CACHE)
(cache / "tiny_corpus").rename(cache / "tester___tiny_corpus")
"""


def test_a_dataset_by_name_from_the_local_cache_offline(tmp_path, docs, tok_file):
    """data=hf data.dataset=tester/tiny_corpus, offline: `datasets` finds the name in the cache under HF_HOME (its
    source file removed first, and the hub's address unreachable, so nothing but the cache can serve it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": docs}), tmp_path / "train.parquet")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    run = functools.partial(subprocess.run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    made = run([sys.executable, "-c", POPULATE, str(tmp_path / "train.parquet")])
    assert made.returncode == 0, made.stderr
    (tmp_path / "train.parquet").unlink()
    out = run([sys.executable, "-m", "asyncpipe", "data", "prepare", "data=hf", "data.dataset=tester/tiny_corpus",
               "data.text_field=content", "tokenizer=hf", f"tokenizer.path={tok_file}", f"data.root={tmp_path}/root"])
    assert out.returncode == 0, out.stderr
    (path,) = (tmp_path / "root").glob("hf-hf-*")
    m = load_manifest(path, verify_hashes=True)
    assert sorted(read_docs(path, "train") + read_docs(path, "val")) == sorted(docs)
    cached = sorted((tmp_path / "hf" / "datasets" / "tester___tiny_corpus").rglob("*.arrow"))
    assert cached and [s["name"] for s in m["sources"]] == [f.name for f in cached]


def test_plan_reports_the_runs_tokens_and_epochs(prepared, tok_file, monkeypatch, capsys):
    path, _ = prepared["parquet"]
    m = load_manifest(path)
    args = ["plan", "model=tiny", "data=files", f"data.paths=[{m['config']['paths'][0]}]", f"data.root={path.parent}",
            "tokenizer=hf", f"tokenizer.path={tok_file}", "train.steps=50", "--no-speed"]
    with pytest.raises(SystemExit):
        main(args)
    lines = capsys.readouterr().out.strip().splitlines()
    epochs = 50 * 4 * 8 * 64 / m["tokens"]["train"]
    assert lines[-2] == (f"data: 50 steps x 2,048 tokens = 102,400 tokens = {epochs:.3g} epochs of {path.name}'s "
                         f"{m['tokens']['train']:,} train tokens" + (" (data repeated)" if epochs > 1 else ""))
    assert lines[-1].startswith("verdict:")


def test_loader_keeps_a_bounded_number_of_shards_open(tmp_path, docs, tok_file, monkeypatch):
    import asyncpipe.data.loader as loader

    paths, kw = write_text_files(tmp_path, docs)
    path = prepare(*cfgs(tmp_path / "root", tok_file, paths=paths, shard_mb=0.002, **kw))
    m = load_manifest(path)
    flat = np.concatenate([np.fromfile(path / f, dtype=m["dtype"]) for f in split_files(m, "train")])
    monkeypatch.setattr(loader, "OPEN_SHARDS", 3)
    mb = MicroBatches(path, "train", 100, 16, seed=1)
    for i in range(10):
        x, _ = mb.get(i)
        assert [row.tolist() for row in x] == [flat[o : o + 100].tolist() for o in mb.offsets(i)]
        assert len(mb._tokens) <= 3
