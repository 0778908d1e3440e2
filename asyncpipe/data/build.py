"""Your own corpus prepared at a cluster's scale (`data=files`, `data=tokens`, `data=hf`): streamed, in parallel
(`data.workers` processes over shards; a file of two shards' size or more is cut into parts, `asyncpipe.data.ranges`),
resumable, written as token shards plus a manifest (format 2).

The work happens in `{root}/.{name}.partial/`, under the dataset's lock (`dataset.locked`): `plan.json` says what
is being built; each finished shard has its `shard-NNNNN.json`. A preparation killed midway keeps its finished
shards; the next one (same plan) redoes only the rest and ends with the same bytes as an uninterrupted run. A bad
input removes the partial directory: nothing half-written is left in the data root. The finished directory is
renamed into place, so a directory with a manifest is always complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from asyncpipe.data.idsources import dataset_files, open_dataset, token_dtype
from asyncpipe.data.meter import Meter
from asyncpipe.data.ranges import byte_spans, row_group_spans, splittable
from asyncpipe.data.shards import SPLIT_KEYS, SPLITS, ShardJob, Unit, meta_name, run_shard
from asyncpipe.data.sources import expand_paths, parquet_row_groups, sha256_file
from asyncpipe.data.tokenizer import TOKENIZER_FILE, text_tokenizer
from asyncpipe.errors import UserError

STREAMED = ("files", "tokens", "hf")
FORMAT = 2
PLAN = "plan.json"
Progress = Callable[[str], None]


def _tokenizer_spec(tok_cfg) -> dict:
    path = str(tok_cfg.get("path", "") or "")
    return {
        "name": str(tok_cfg.name),
        "vocab_size": int(tok_cfg.vocab_size),
        "eot": str(tok_cfg.get("eot", "") or ""),
        "path": str(Path(path).expanduser().absolute()) if path.strip() else "",
    }


_FILE_HASH: dict[tuple, str] = {}


def requested_tokenizer(tok_cfg) -> dict:
    """The tokenizer as a dataset records it: name, vocabulary, end-of-text token, file and its sha256 (cached by
    the file's size and modification time: runs ask for it at every start)."""
    tok = _tokenizer_spec(tok_cfg)
    if tok["path"]:
        file = Path(tok["path"])
        try:
            st = file.stat()
        except OSError:
            raise UserError(
                f"tokenizer.path {file} is not a file (tokenizer=hf reads a Hugging Face tokenizer.json)"
            ) from None
        key = (tok["path"], st.st_size, st.st_mtime_ns)
        if key not in _FILE_HASH:
            _FILE_HASH[key] = sha256_file(file)
        tok["sha256"] = _FILE_HASH[key]
    return tok


def requested(data_cfg, tok_cfg) -> dict:
    """What a streamed dataset is built from (its directory name hashes this): sources, reading and split
    settings, the tokenizer and the hash of its file. Workers and shard size change no token, so are left out."""
    tok = requested_tokenizer(tok_cfg)
    if data_cfg.sources:
        raise UserError(f"data.sources is only used by data=docs and data=mix; data={data_cfg.name} reads data.paths")
    return {
        "data": str(data_cfg.name),
        "paths": [str(Path(str(p)).expanduser().absolute()) for p in data_cfg.paths],
        "format": str(data_cfg.format),
        "text_field": str(data_cfg.text_field),
        "separator": str(data_cfg.separator),
        "token_dtype": str(data_cfg.token_dtype),
        "dataset": str(data_cfg.dataset),
        "subset": str(data_cfg.subset),
        "split": str(data_cfg.split),
        "val_fraction": float(data_cfg.val_fraction),
        "split_seed": int(data_cfg.split_seed),
        "split_keys": SPLIT_KEYS,
        "tokenizer": tok,
    }


def dataset_name(data_cfg, tok_cfg) -> str:
    """`{data}-{tokenizer}-{12 hex digits of what it is built from}`: another corpus or tokenizer file is another
    directory, never a rebuild of this one."""
    digest = hashlib.sha256(json.dumps(requested(data_cfg, tok_cfg), sort_keys=True).encode()).hexdigest()[:12]
    return f"{data_cfg.name}-{tok_cfg.name}-{digest}"


def _units(data_cfg, shard_bytes: float) -> list[Unit]:
    """The units of work: each file (named relative to the files' common folder, so the split survives a move of
    the corpus), or its parts when it holds two shards or more; or row ranges of a dataset."""
    if data_cfg.name == "hf":
        ds = open_dataset(str(data_cfg.dataset), str(data_cfg.subset), str(data_cfg.split), str(data_cfg.text_field))
        rows, size = len(ds), max(1, int(ds.data.nbytes))
        per = max(1, int(rows * shard_bytes / size))
        spans = [(a, min(a + per, rows)) for a in range(0, rows, per)]
        return [Unit("rows", span=(a, b), bytes=size * (b - a) // rows) for a, b in spans]
    if data_cfg.paths and data_cfg.dataset:
        raise UserError(f"data.dataset is read by data=hf only (data={data_cfg.name} reads data.paths)")
    files = expand_paths([str(p) for p in data_cfg.paths])
    base = Path(os.path.commonpath([str(f.parent) for f in files]))
    units = []
    for f in files:
        name, size = str(f.relative_to(base)), f.stat().st_size
        cut = splittable(f, str(data_cfg.format), str(data_cfg.separator)) if data_cfg.name == "files" else ""
        parts: list[Unit] = []
        if size >= 2 * shard_bytes and cut in ("lines", "separator"):
            spans = byte_spans(f, size, shard_bytes, str(data_cfg.separator) if cut == "separator" else "")
            parts = [Unit(name, path=str(f), span=s, bytes=s[1] - s[0]) for s in spans]
        elif size >= 2 * shard_bytes and cut == "row groups":
            groups = parquet_row_groups(f)
            spans = row_group_spans(groups, shard_bytes)
            parts = [Unit(name, path=str(f), span=(a, b), bytes=sum(groups[a:b])) for a, b in spans]
        units += parts if len(parts) > 1 else [Unit(name, path=str(f), bytes=size)]
    return units


def _shards(units: list[Unit], shard_bytes: float) -> list[tuple[Unit, ...]]:
    """Consecutive units grouped until a shard holds `shard_bytes` of input; a part of a file is a shard of its
    own."""
    out, cur, size = [], [], 0
    for unit in units:
        if unit.span is not None and unit.path:
            out += [tuple(cur)] if cur else []
            out.append((unit,))
            cur, size = [], 0
            continue
        cur.append(unit)
        size += unit.bytes
        if size >= shard_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
    return out + ([tuple(cur)] if cur else [])


def plan(data_cfg, tok_cfg) -> tuple[dict, list[ShardJob]]:
    """What will be built (the JSON of plan.json: requested config, units with sizes and modification times, shard
    grouping) and the shard jobs."""
    want = requested(data_cfg, tok_cfg)
    tok = want["tokenizer"]
    dtype = np.dtype("<u2") if tok["vocab_size"] <= 2**16 else np.dtype("<u4")
    if data_cfg.name == "tokens":
        dtype = token_dtype("auto", tok["vocab_size"])
    shard_mb = float(data_cfg.shard_mb)
    if not shard_mb > 0:
        raise UserError(f"data.shard_mb={shard_mb} must be > 0 (input megabytes per shard)")
    groups = _shards(_units(data_cfg, shard_mb * 1e6), shard_mb * 1e6)
    source = {k: want[k] for k in ("format", "text_field", "separator", "token_dtype", "dataset", "subset", "split")}
    source["kind"] = str(data_cfg.name)
    split = {"seed": want["split_seed"], "val_fraction": want["val_fraction"]}
    jobs = [ShardJob(i, g, source, tok, split, dtype.str, "") for i, g in enumerate(groups)]
    mtimes = [os.stat(u.path).st_mtime_ns if u.path else 0 for g in groups for u in g]
    described = {
        "requested": want,
        "dtype": dtype.name,
        "shards": [[[u.label, u.bytes] for u in g] for g in groups],
        "mtimes": mtimes,
    }
    return described, jobs


def _finished(work: Path, index: int) -> dict | None:
    """Shard `index`'s record when it finished and its files are there at their recorded sizes."""
    path = work / meta_name(index)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for info in record.get("files", {}).values():
        file = work / info["file"] if info is not None else None
        if file is not None and not (file.is_file() and file.stat().st_size == info["bytes"]):
            return None
    return record


def _start(work: Path, described: dict) -> None:
    """The partial directory for this plan: kept when it holds the same plan (its finished shards are reused),
    otherwise made anew; files a killed worker left half-written are removed."""
    plan_file = work / PLAN
    if work.exists():
        try:
            same = json.loads(plan_file.read_text()) == described
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(work)
    work.mkdir(mode=0o755, exist_ok=True)
    for leftover in work.glob("*.part"):
        leftover.unlink()
    if not plan_file.is_file():
        plan_file.write_text(json.dumps(described, indent=2) + "\n")


_COUNTER: Any = None
_PARENT = 0


def _init_worker(counter: Any, parent: int) -> None:
    global _COUNTER, _PARENT
    os.environ["RAYON_NUM_THREADS"] = "1"  # a worker per core: the tokenizer's own threads would oversubscribe
    _COUNTER, _PARENT = counter, parent


def _report(n: int) -> None:
    if os.getppid() != _PARENT:  # the preparation was killed: its lock is gone, so stop writing
        os._exit(1)
    with _COUNTER.get_lock():
        _COUNTER.value += n


def _work(job: ShardJob) -> dict:
    return run_shard(job, _report)


def _run_jobs(jobs: list[ShardJob], workers: int, meter: Meter) -> None:
    """Run the shard jobs: in this process with one worker, else in a pool of spawned processes (a clean
    interpreter: the caller may hold torch's threads). The first failure stops every worker and is raised."""
    if workers <= 1:
        for job in jobs:

            def report(n: int) -> None:
                meter.update(meter.done + n)

            run_shard(job, report)
        return
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("q", 0)
    base = meter.done
    safe = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"  # a spawned worker (`python -c`) never imports from the working dir
    try:  # the pool starts its workers now: the setting is theirs, not this process's later children's
        pool = ctx.Pool(min(workers, len(jobs)), initializer=_init_worker, initargs=(counter, os.getpid()))
    finally:
        if safe is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = safe
    try:
        pending = [pool.apply_async(_work, (job,)) for job in jobs]
        while pending:
            time.sleep(0.2)
            meter.update(base + counter.value)
            for res in [r for r in pending if r.ready()]:
                res.get()  # raises a worker's error here
                pending.remove(res)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def build(data_cfg, tok_cfg, target: Path, progress: Progress) -> Path:
    """Build (or finish) the streamed dataset `target`; the caller holds its lock."""
    from dataclasses import replace

    described, jobs = plan(data_cfg, tok_cfg)
    tok = text_tokenizer(tok_cfg)  # a bad tokenizer file fails here, before any shard
    work = target.parent / f".{target.name}.partial"
    workers = int(data_cfg.workers)
    if workers < 1:
        raise UserError(f"data.workers={workers} must be >= 1 (processes preparing shards)")
    _start(work, described)
    jobs = [replace(job, work=str(work)) for job in jobs]
    records = {j.index: r for j in jobs if (r := _finished(work, j.index)) is not None}
    todo = [j for j in jobs if j.index not in records]
    total = sum(u.bytes for j in jobs for u in j.units)
    done = sum(u.bytes for j in jobs if j.index in records for u in j.units)
    kept = f", {len(records)} kept from an interrupted run" if records else ""
    progress(
        f"{data_cfg.name}: {len(described['shards'])} shard(s) from {sum(len(j.units) for j in jobs)} unit(s), "
        f"{total / 1e6:,.1f} MB{kept}; {min(workers, max(1, len(todo)))} worker(s)"
    )
    meter = Meter(total, done, f"prepare {target.name}", progress)
    try:
        _run_jobs(todo, workers, meter)
    except UserError:
        shutil.rmtree(work, ignore_errors=True)  # the input must change: nothing of it is kept
        raise
    finally:
        meter.close()
    progress(meter.line())
    records = {j.index: _finished(work, j.index) for j in jobs}
    manifest = _manifest(data_cfg, described, [records[j.index] for j in jobs], tok, work)
    return _publish(work, target, manifest, len(jobs))


def _manifest(data_cfg, described: dict, records: list, tok, work: Path) -> dict:
    from asyncpipe import __version__

    want = described["requested"]
    documents = {s: sum(r["documents"][s] for r in records) for s in SPLITS}
    for split in SPLITS:
        if documents[split] == 0:
            shutil.rmtree(work, ignore_errors=True)
            raise UserError(
                f"data={data_cfg.name}: the {split} split got no document of {sum(documents.values())} "
                f"(data.val_fraction={want['val_fraction']}); add documents or change data.val_fraction"
            )
    shards = {s: [r["files"][s]["file"] for r in records if r["files"][s]] for s in SPLITS}
    files = {
        r["files"][s]["file"]: {k: r["files"][s][k] for k in ("tokens", "bytes", "sha256")}
        for r in records
        for s in SPLITS
        if r["files"][s]
    }
    tok_info: dict = {
        "name": want["tokenizer"]["name"],
        "vocab_size": want["tokenizer"]["vocab_size"],
        "eot_id": None if tok is None else tok.eot_id,
    }
    if want["tokenizer"]["path"]:
        shutil.copyfile(want["tokenizer"]["path"], work / TOKENIZER_FILE)
        tok_info.update(file=TOKENIZER_FILE, sha256=want["tokenizer"]["sha256"])
    elif tok is not None and tok.name == "gpt2":
        tok.save(work / TOKENIZER_FILE)
        tok_info.update(file=TOKENIZER_FILE, sha256=sha256_file(work / TOKENIZER_FILE))
    return {
        "format": FORMAT,
        "asyncpipe_version": __version__,
        "corpus": str(data_cfg.name),
        "config": want,
        "sources": _hf_sources(data_cfg) if data_cfg.name == "hf" else [e for r in records for e in r["sources"]],
        "documents": documents,
        "tokens": {s: sum(files[f]["tokens"] for f in shards[s]) for s in SPLITS},
        "dtype": described["dtype"],
        "tokenizer": tok_info,
        "shards": shards,
        "files": files,
    }


def _hf_sources(data_cfg) -> list[dict]:
    """A dataset's Arrow files, hashed: what its rows were read from."""
    ds = open_dataset(str(data_cfg.dataset), str(data_cfg.subset), str(data_cfg.split), str(data_cfg.text_field))
    return [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in dataset_files(ds)]


def _publish(work: Path, target: Path, manifest: dict, n_shards: int) -> Path:
    """Write the manifest, drop the build's own records, and rename the directory into place (durably)."""
    tmp = work / "manifest.json.part"
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, work / "manifest.json")
    for i in range(n_shards):
        (work / meta_name(i)).unlink(missing_ok=True)
    (work / PLAN).unlink(missing_ok=True)
    swap_into_place(work, target)
    return target


def swap_into_place(work: Path, target: Path) -> None:
    """Rename the finished directory ``work`` to ``target`` (an older ``target`` moved aside, then removed) and
    fsync their parent, so the rename is durable before anyone trusts the manifest inside."""
    root = target.parent
    old = None
    if target.exists():
        old = root / f".{target.name}.tmp-old-{os.getpid()}"
        target.rename(old)
    work.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
