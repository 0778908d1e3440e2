"""Random-access micro-batches over a memory-mapped token split (one file, or any number of shards read as
their concatenation), and a resumable cursor over them.

Micro-batch i is a pure function of (seed, split, i): data-parallel replicas, resumed runs and an
uninterrupted run all read the same tokens for the same i, with no loader state beyond a position.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from asyncpipe.data.dataset import SPLITS, load_manifest, split_files
from asyncpipe.errors import UserError


OPEN_SHARDS = 256  # memmaps kept open at once


class MicroBatches:
    """`get(i) -> (x, y)`: B windows of seq_len+1 tokens at offsets drawn from rng([seed, split, i])."""

    def __init__(self, path: Path | str, split: str, seq_len: int, micro_batch_size: int, seed: int) -> None:
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
        if seq_len < 1 or micro_batch_size < 1:
            raise UserError(f"seq_len and micro_batch_size must be >= 1 (got {seq_len}, {micro_batch_size})")
        if seed < 0:
            raise UserError(f"the data seed must be >= 0 (got {seed})")
        self.path = Path(path)
        self.manifest = load_manifest(self.path)
        self.split, self.seq_len, self.micro_batch_size, self.seed = split, seq_len, micro_batch_size, seed
        self.vocab_size: int = self.manifest["tokenizer"]["vocab_size"]
        self.n_tokens: int = self.manifest["tokens"][split]
        if self.n_tokens < seq_len + 1:
            raise UserError(f"seq_len {seq_len} too long for split {split} with {self.n_tokens} tokens")
        self._tokens = self._open()
        self._split_id = SPLITS.index(split)

    def __getstate__(self) -> dict:
        # Pickling an np.memmap copies the whole split; ship the path and reopen on the other side.
        state = self.__dict__.copy()
        del state["_tokens"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = self._open()

    def _open(self) -> "OrderedDict[int, np.ndarray]":
        """The split's token files and where each starts in their concatenation (sizes from the manifest, which
        `load_manifest` checked against the files); memmaps are opened on first use, at most `OPEN_SHARDS` at once
        (each holds a file descriptor: a corpus of 10,000 shards would pass the usual limit of 1,024)."""
        self._files = split_files(self.manifest, self.split)
        itemsize = np.dtype(self.manifest["dtype"]).itemsize
        self._starts = np.cumsum([0] + [self.manifest["files"][f]["bytes"] // itemsize for f in self._files])
        return OrderedDict()

    def _shard(self, k: int) -> np.ndarray:
        maps = self._tokens
        if k in maps:
            maps.move_to_end(k)
            return maps[k]
        if len(maps) >= OPEN_SHARDS:
            maps.popitem(last=False)
        dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        maps[k] = np.memmap(self.path / self._files[k], dtype=dtype, mode="r")
        return maps[k]

    def window(self, offset: int, length: int) -> np.ndarray:
        """Tokens offset..offset+length-1 of the split, across shard boundaries where the window spans them."""
        k = int(np.searchsorted(self._starts, offset, side="right")) - 1
        local = offset - int(self._starts[k])
        piece = self._shard(k)[local : local + length]
        if len(piece) == length:
            return piece
        parts, need = [np.array(piece)], length - len(piece)
        while need > 0:
            k += 1
            parts.append(np.array(self._shard(k)[:need]))
            need -= len(parts[-1])
        return np.concatenate(parts)

    def offsets(self, i: int) -> np.ndarray:
        """Start offsets of the B windows of micro-batch i (uniform over every full window)."""
        if i < 0:
            raise ValueError(f"micro-batch index must be >= 0, got {i}")
        rng = np.random.default_rng([self.seed, self._split_id, i])
        return rng.integers(0, self.n_tokens - self.seq_len, size=self.micro_batch_size)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th micro-batch: x, y LongTensors [B, T], y the next-token targets (x shifted left by one)."""
        windows = np.stack([self.window(int(o), self.seq_len + 1) for o in self.offsets(i)]).astype(np.int64)
        buf = torch.from_numpy(windows)
        return buf[:, :-1], buf[:, 1:]


class Loader:
    """A cursor over `MicroBatches`: `next()` returns micro-batch `position` and advances it."""

    def __init__(self, micro_batches: MicroBatches, start: int = 0) -> None:
        self.micro_batches = micro_batches
        self.position = start

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.micro_batches.get(self.position)
        self.position += 1
        return batch

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
