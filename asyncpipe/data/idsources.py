"""Sources that are not plain files of text: token ids made elsewhere (`data=tokens`: nanoGPT's flat
uint16/uint32 `.bin`, NumPy `.npy`) and a Hugging Face `datasets` dataset (`data=hf`).

Token files are read by memmap a chunk at a time and cut into documents after each end-of-text id (or into
fixed blocks when the vocabulary declares none); an id beyond the vocabulary is refused with its position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from asyncpipe.data.sources import SourceError
from asyncpipe.errors import UserError

TOKEN_DTYPES = ("auto", "uint16", "uint32")
BLOCK_TOKENS = 2048  # a "document" of ids without an end-of-text marker (the unit of the train/val split)
CHUNK_TOKENS = 1 << 22  # ids read per step


def token_dtype(declared: str, vocab_size: int) -> np.dtype:
    """The dtype of a flat `.bin`: declared, or auto: uint16 when the vocabulary fits (nanoGPT's choice)."""
    if declared not in TOKEN_DTYPES:
        raise UserError(f"data.token_dtype={declared} is not one of {', '.join(TOKEN_DTYPES)}")
    if declared == "auto":
        declared = "uint16" if vocab_size <= 2**16 else "uint32"
    return np.dtype(declared).newbyteorder("<")


def open_ids(path: Path, declared: str, vocab_size: int) -> np.ndarray:
    """The file's ids as a read-only 1-D array (memmapped); a truncated or wrongly typed file is one line."""
    try:
        if path.suffix.lower() == ".npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise SourceError(
                    f"{path}: a token file holds a 1-D array of integer ids (found {arr.dtype}, shape {arr.shape})"
                )
            if arr.size == 0:
                raise SourceError(f"{path}: empty token file (no ids)")
            return arr
        dtype = token_dtype(declared, vocab_size)
        size = path.stat().st_size
        if size == 0:
            raise SourceError(f"{path}: empty token file (no ids)")
        if size % dtype.itemsize:
            raise SourceError(
                f"{path}: {size} bytes is not a whole number of {dtype.name} ids: truncated, or "
                "another data.token_dtype"
            )
        return np.memmap(path, dtype=dtype, mode="r")
    except SourceError:
        raise
    except (OSError, ValueError, EOFError) as err:
        raise SourceError(f"{path}: unreadable or truncated token file ({err})") from None


def read_ids(path: Path, declared: str, vocab_size: int, eot: int | None) -> Iterator[tuple[list[np.ndarray], int]]:
    """Documents of ids (each ending with its end-of-text id, else `BLOCK_TOKENS` long) and bytes read so far."""
    arr = open_ids(path, declared, vocab_size)
    n, itemsize = int(arr.shape[0]), arr.dtype.itemsize
    carry = np.empty(0, dtype=arr.dtype)
    for start in range(0, n, CHUNK_TOKENS):
        try:
            chunk = np.asarray(arr[start : start + CHUNK_TOKENS])
        except OSError as err:
            raise SourceError(f"{path}: unreadable token file ({err})") from None
        _check_range(path, chunk, start, vocab_size)
        if eot is not None:
            cuts = np.flatnonzero(chunk == eot) + 1
        else:  # blocks at fixed absolute positions, so the cut does not depend on the chunking
            first = -start % BLOCK_TOKENS
            cuts = np.arange(first if first else BLOCK_TOKENS, len(chunk) + 1, BLOCK_TOKENS)
        pieces = np.split(chunk, cuts)
        pieces[0] = np.concatenate([carry, pieces[0]])
        carry = pieces.pop()
        yield [p for p in pieces if len(p)], (start + len(chunk)) * itemsize
    if len(carry):
        yield [carry], n * itemsize


def _check_range(path: Path, chunk: np.ndarray, start: int, vocab_size: int) -> None:
    out = chunk >= vocab_size
    if chunk.dtype.kind == "i":  # a signed .npy may hold negative ids
        out |= chunk < 0
    bad = np.flatnonzero(out)
    if len(bad):
        pos = int(bad[0])
        raise SourceError(
            f"{path}: token id {int(chunk[pos])} at position {start + pos} is beyond the vocabulary "
            f"({vocab_size} ids; tokenizer.vocab_size declares it)"
        )


# --- data=hf: a Hugging Face `datasets` dataset -------------------------------------------------------------


def open_dataset(dataset: str, subset: str, split: str, text_field: str) -> Any:
    """The split of a `datasets` dataset: a directory written by `save_to_disk`, else a name loaded from the local
    cache (or the hub when online; `HF_HUB_OFFLINE=1` / `HF_DATASETS_OFFLINE=1` are honoured by `datasets`)."""
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the `datasets` package: pip install datasets") from None
    if not dataset.strip():
        raise UserError("data=hf needs data.dataset=NAME (on the hub or in the cache) or a save_to_disk directory")
    local = Path(dataset).expanduser()
    try:
        if local.is_dir():
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(dataset, subset or None, split=split)
    except Exception as err:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError, ...)
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"data.dataset={dataset}: cannot be loaded ({type(err).__name__}: {detail})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"data.dataset={dataset} has no split {split!r} (it has {', '.join(ds)}); set data.split")
        ds = ds[split]
    if text_field not in ds.column_names:
        raise UserError(
            f"data.dataset={dataset}: no column {text_field!r} (it has {', '.join(ds.column_names)}); "
            "set data.text_field"
        )
    return ds


def dataset_files(ds: Any) -> list[Path]:
    """The Arrow files a dataset reads (hashed into the manifest as its sources)."""
    return sorted({Path(f["filename"]) for f in ds.cache_files})


def read_rows(ds: Any, start: int, stop: int, text_field: str) -> Iterator[tuple[list[str], int]]:
    """The texts of rows [start, stop), 1024 at a time, with the rows read so far; a null or non-text row is one
    line naming it."""
    for a in range(start, stop, 1024):
        values = ds[a : min(a + 1024, stop)][text_field]
        bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
        if bad is not None:
            raise SourceError(f"dataset row {a + bad}: column {text_field!r} is {type(values[bad]).__name__}, not text")
        yield values, min(a + 1024, stop) - start
