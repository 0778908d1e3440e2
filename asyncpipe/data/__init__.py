"""Corpora, tokenizers, one-time preparation into memmapped token files, and random-access batches.

`MicroBatches` and `Loader` import torch, so they are loaded on first use: `asyncpipe data prepare`
stays light.
"""

from asyncpipe.data.dataset import dataset_dir, describe, ensure_prepared, load_manifest, prepare
from asyncpipe.data.tokenizer import get_tokenizer

__all__ = [
    "Loader",
    "MicroBatches",
    "dataset_dir",
    "describe",
    "ensure_prepared",
    "get_tokenizer",
    "load_manifest",
    "prepare",
]


def __getattr__(name: str):
    if name in ("MicroBatches", "Loader"):
        from asyncpipe.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
