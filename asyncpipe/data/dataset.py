"""Prepare a corpus once: split documents into train/val, tokenize, write memmap-able token files.

An embedded corpus's dataset directory holds `train.bin`, `val.bin` (flat little-endian uint16/uint32 ids),
`manifest.json` (format 1) and, for BPE tokenizers, `tokenizer.json`. It is built in a temporary directory and
renamed into place, so a directory with a manifest is always complete. Your own corpus (data=files, tokens, hf)
is streamed into shards instead (`asyncpipe.data.build`, manifest format 2), under the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from asyncpipe.data import build as streamed
from asyncpipe.data.corpora import load_corpus
from asyncpipe.data.tokenizer import TOKENIZER_FILE, HFTokenizer, build_tokenizer, check_tokenizer, text_tokenizer
from asyncpipe.errors import UserError

MANIFEST = "manifest.json"
SPLITS = ("train", "val")
FORMAT = 1  # bump when the layout or the meaning of a manifest field changes
FORMATS = (FORMAT, streamed.FORMAT)  # format 2: shards listed in the manifest (`asyncpipe.data.build`)
_CHUNK_DOCS = 256  # documents tokenized per batch: bounds memory on large corpora

Progress = Callable[[str], None]


def dataset_dir(data_cfg, tok_cfg) -> Path:
    """Where the prepared files of this corpus/tokenizer pair live: `{root}/{data}-{tokenizer}[-{vocab}]`, or
    `{root}/{data}-{tokenizer}-{digest}` for your own corpus (`build.dataset_name`)."""
    name = f"{data_cfg.name}-{tok_cfg.name}"
    if tok_cfg.name == "bpe":
        name += f"-{tok_cfg.vocab_size}"
    if tok_cfg.name == "hf":  # another tokenizer file is another directory
        name += "-" + streamed.requested_tokenizer(tok_cfg)["sha256"][:12]
    if data_cfg.name in streamed.STREAMED:
        name = streamed.dataset_name(data_cfg, tok_cfg)
    if not str(data_cfg.root).strip():  # Path("") would put token files in the working directory
        from asyncpipe.paths import data_root

        data_root(data_cfg.root)  # the one-line refusal
    return Path(str(data_cfg.root)).expanduser() / name


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of train and val documents (each sorted); at least one document on each side."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be between 0 and 1 (got {val_fraction})")
    if n_docs < 2:
        raise UserError(f"the corpus has {n_docs} document(s); a train/val split needs at least 2")
    order = np.random.default_rng(seed).permutation(n_docs)
    n_val = min(max(1, round(n_docs * val_fraction)), n_docs - 1)
    return sorted(order[n_val:].tolist()), sorted(order[:n_val].tolist())


def requested_config(data_cfg, tok_cfg) -> dict:
    """What a manifest must have been built from for `ensure_prepared` to reuse it."""
    if data_cfg.name in streamed.STREAMED:
        return streamed.requested(data_cfg, tok_cfg)
    return {
        "data": str(data_cfg.name),
        "sources": [str(s) for s in data_cfg.sources],
        "val_fraction": float(data_cfg.val_fraction),
        "split_seed": int(data_cfg.split_seed),
        "tokenizer": str(tok_cfg.name),
        "vocab_size": int(tok_cfg.vocab_size),
    }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_tokens(path: Path, docs: list[str], tokenizer, dtype: np.dtype) -> dict:
    """Tokenize `docs` into `path` (EOT after each document when the tokenizer has one)."""
    h, n_tokens = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for start in range(0, len(docs), _CHUNK_DOCS):
            for ids in tokenizer.encode_batch(docs[start : start + _CHUNK_DOCS]):
                if tokenizer.eot_id is not None:
                    ids = ids + [tokenizer.eot_id]
                data = np.asarray(ids, dtype=dtype).tobytes()
                h.update(data)
                f.write(data)
                n_tokens += len(ids)
        f.flush()
        os.fsync(f.fileno())
    return {"tokens": n_tokens, "bytes": n_tokens * dtype.itemsize, "sha256": h.hexdigest()}


def _build(data_cfg, tok_cfg, work: Path, progress: Progress) -> dict:
    """Write every file of the dataset into the empty directory `work`; returns the manifest."""
    t0 = time.perf_counter()
    from asyncpipe import __version__

    downloads = dataset_dir(data_cfg, tok_cfg).parent / "_downloads"  # shared by all datasets under the root
    corpus = load_corpus(str(data_cfg.name), list(data_cfg.sources), downloads, progress)
    n_docs = len(corpus.documents)
    train_idx, val_idx = split_documents(n_docs, float(data_cfg.val_fraction), int(data_cfg.split_seed))
    docs = {"train": [corpus.documents[i] for i in train_idx], "val": [corpus.documents[i] for i in val_idx]}
    progress(f"{corpus.name}: {n_docs} documents ({len(train_idx)} train, {len(val_idx)} val)")

    if tok_cfg.name == "bpe":
        progress(f"training bpe (vocab {tok_cfg.vocab_size}) on the train split")
    if tok_cfg.name == "hf":
        tokenizer = text_tokenizer(tok_cfg)
    else:
        tokenizer = build_tokenizer(str(tok_cfg.name), int(tok_cfg.vocab_size), docs["train"])
    tok_info = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id}
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(work / TOKENIZER_FILE)
        tok_info.update(file=TOKENIZER_FILE, sha256=_sha256_file(work / TOKENIZER_FILE))
    dtype = np.dtype("<u2") if tokenizer.vocab_size <= 2**16 else np.dtype("<u4")

    files, tokens = {}, {}
    for split in SPLITS:
        progress(f"tokenizing {split} ({len(docs[split])} documents)")
        info = _write_tokens(work / f"{split}.bin", docs[split], tokenizer, dtype)
        tokens[split] = info.pop("tokens")
        files[f"{split}.bin"] = info
    return {
        "format": FORMAT,
        "asyncpipe_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "corpus": corpus.name,
        "config": requested_config(data_cfg, tok_cfg),
        "sources": corpus.sources,
        "documents": {"train": len(train_idx), "val": len(val_idx)},
        "val_documents": val_idx,
        "tokens": tokens,
        "dtype": dtype.name,
        "tokenizer": tok_info,
        "files": files,
        "prepare_seconds": round(time.perf_counter() - t0, 3),
    }


@contextlib.contextmanager
def _locked(target: Path, progress: Progress) -> Iterator[None]:
    """Hold an exclusive lock on `{root}/.{name}.lock` so two processes never build one dataset at once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process preparing {target}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare_locked(data_cfg, tok_cfg, target: Path, progress: Progress) -> Path:
    root = target.parent
    # Leftovers of a process killed mid-build: safe to delete, since we hold the lock.
    for stale in root.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    os.chmod(work, 0o755)  # mkdtemp makes it private; a shared data root must stay readable
    try:
        manifest = _build(data_cfg, tok_cfg, work, progress)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        streamed.swap_into_place(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    progress(f"wrote {target}")
    return target


def _quiet(_: str) -> None:
    pass


def _check_source(data_cfg, tok_cfg) -> None:
    """The keys of the other kind of corpus are refused, not ignored; the tokenizer is checked."""
    check_tokenizer(tok_cfg)
    name, tok = str(data_cfg.name), str(tok_cfg.name)
    if name not in streamed.STREAMED and (data_cfg.get("paths") or data_cfg.get("dataset")):
        raise UserError(f"data.paths and data.dataset are read by data=files, tokens and hf; data={name} is built in")
    if tok == "ids" and name != "tokens":
        raise UserError(f"tokenizer=ids declares token ids prepared elsewhere: data=tokens only (got data={name})")


def prepare(data_cfg, tok_cfg, progress: Progress | None = None) -> Path:
    """(Re)build the dataset directory of this corpus/tokenizer pair and return it; your own corpus (data=files,
    tokens, hf) is reused when complete and resumed when a preparation of it was interrupted."""
    _check_source(data_cfg, tok_cfg)
    target = dataset_dir(data_cfg, tok_cfg)
    progress = progress or _quiet
    if data_cfg.name in streamed.STREAMED:
        return ensure_prepared(data_cfg, tok_cfg, progress)
    with _locked(target, progress):
        return _prepare_locked(data_cfg, tok_cfg, target, progress)


def ensure_prepared(data_cfg, tok_cfg, progress: Progress | None = None) -> Path:
    """The dataset directory, prepared first if it has no manifest; refuses one built with other settings."""
    _check_source(data_cfg, tok_cfg)
    target = dataset_dir(data_cfg, tok_cfg)
    progress = progress or _quiet
    if not (target / MANIFEST).is_file():
        if data_cfg.name in ("files", "tokens"):  # a glob that matches nothing is refused before the lock file
            streamed.expand_paths([str(p) for p in data_cfg.paths])
        with _locked(target, progress):
            if not (target / MANIFEST).is_file():  # another process may have built it while we waited
                if data_cfg.name in streamed.STREAMED:
                    streamed.build(data_cfg, tok_cfg, target, progress)
                else:
                    _prepare_locked(data_cfg, tok_cfg, target, progress)
    manifest = load_manifest(target)
    wanted, found = requested_config(data_cfg, tok_cfg), manifest.get("config", {})
    diff = [f"{k}={found.get(k)!r} (wanted {v!r})" for k, v in wanted.items() if found.get(k) != v]
    if diff:
        raise UserError(
            f"{target} was prepared with {', '.join(diff)}; rebuild it with `asyncpipe data prepare` "
            "or point data.root elsewhere"
        )
    return target


def _prepare_hint(path: Path) -> str:
    parts = path.name.split("-")
    if len(parts) == 2:
        return f"asyncpipe data prepare data={parts[0]} tokenizer={parts[1]}"
    if len(parts) == 3 and parts[1] == "bpe":
        return f"asyncpipe data prepare data={parts[0]} tokenizer=bpe tokenizer.vocab_size={parts[2]}"
    return "asyncpipe data prepare data=... tokenizer=..."


def load_manifest(path: Path | str, verify_hashes: bool = False) -> dict:
    """The manifest of a dataset dir, after checking its token files are all there at the recorded sizes."""
    path = Path(path)
    if path.name == MANIFEST:
        path = path.parent
    manifest_path = path / MANIFEST
    rerun = f"run `{_prepare_hint(path)}`"
    if not manifest_path.is_file():
        raise UserError(f"no data manifest at {manifest_path}; {rerun}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"data manifest {manifest_path} is not valid JSON ({err}); {rerun}") from None
    if manifest.get("format") not in FORMATS:
        raise UserError(
            f"data manifest {manifest_path} has format {manifest.get('format')!r}, "
            f"this asyncpipe reads {' and '.join(map(str, FORMATS))}; {rerun}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        names = split_files(manifest, split)
        if sum(manifest["files"][n]["bytes"] for n in names) != manifest["tokens"][split] * itemsize:
            raise UserError(f"data manifest {manifest_path} is inconsistent: {split} tokens and bytes disagree")
        for name in names:
            _check_token_file(path / name, manifest["files"][name], verify_hashes, rerun)
    tok_file = manifest["tokenizer"].get("file")
    if tok_file and not (path / tok_file).is_file():
        raise UserError(f"tokenizer file {path / tok_file} is missing; {rerun}")
    if tok_file and verify_hashes and _sha256_file(path / tok_file) != manifest["tokenizer"]["sha256"]:
        raise UserError(f"tokenizer file {path / tok_file} does not match its sha256 in the manifest; {rerun}")
    return manifest


def split_files(manifest: dict, split: str) -> list[str]:
    """The token files of a split, in order: `{split}.bin` (format 1) or its shards (format 2)."""
    return list(manifest["shards"][split]) if "shards" in manifest else [f"{split}.bin"]


def _check_token_file(file: Path, info: dict, verify_hashes: bool, rerun: str) -> None:
    """One line when a token file is missing, unreadable, truncated or (with `verify_hashes`) altered."""
    if not file.is_file():
        raise UserError(f"token file {file} is missing; {rerun}")
    if not os.access(file, os.R_OK):
        raise UserError(f"token file {file} is not readable (permissions); {rerun}")
    actual, expected = file.stat().st_size, info["bytes"]
    if actual != expected:
        raise UserError(f"token file {file} has {actual} bytes, the manifest says {expected}; {rerun}")
    if verify_hashes and _sha256_file(file) != info["sha256"]:
        raise UserError(f"token file {file} does not match its sha256 in the manifest; {rerun}")


def describe(path: Path | str) -> str:
    """One line for the CLI: documents, tokens, dtype and vocabulary of a prepared dataset."""
    path = Path(path)
    m = load_manifest(path)
    docs, tokens = m["documents"], m["tokens"]
    return (
        f"{path.name}: {docs['train'] + docs['val']} documents ({docs['train']} train, {docs['val']} val), "
        f"{tokens['train']:,} train + {tokens['val']:,} val tokens, "
        f"{m['dtype']}, vocab {m['tokenizer']['vocab_size']}"
    )


def run_data_line(cfg) -> str:
    """One line for `asyncpipe plan`: the run's tokens and the passes over its prepared train split they make
    (epochs > 1: data repeated), or that the dataset is not prepared yet."""
    from asyncpipe.config.tuned import run_regime

    regime = run_regime(cfg)
    steps, per_step = regime["steps"], regime["tokens_per_step"]
    reads = f"{steps} steps x {per_step:,} tokens = {steps * per_step:,} tokens"
    path = dataset_dir(cfg.data, cfg.tokenizer)
    if not (path / MANIFEST).is_file():
        return (
            f"data: {reads}; {path} is not prepared yet (`asyncpipe data prepare` with the same data= and tokenizer=)"
        )
    train = int(load_manifest(path)["tokens"]["train"])
    epochs = steps * per_step / train
    return f"data: {reads} = {epochs:.3g} epochs of {path.name}'s {train:,} train tokens" + (
        " (data repeated)" if epochs > 1 else ""
    )
