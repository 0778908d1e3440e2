"""The `docs` corpus: reStructuredText and text files from Debian documentation packages.

Packages are fetched at prepare time with `apt-get download` into a cache under the data root and
unpacked with `dpkg -x`; nothing is vendored. A cached .deb is reused, so a rebuild needs no network.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from asyncpipe.data.corpus import Corpus, source_entry
from asyncpipe.errors import UserError

# Text formats kept: Sphinx sources (.rst, .rst.txt), plain text, and Perl's POD for perl-doc.
SUFFIXES = (".rst", ".txt", ".pod")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError(f"`{cmd[0]}` is not available; data=docs needs a Debian/Ubuntu system with apt") from None
    except subprocess.CalledProcessError as err:
        lines = [ln for ln in (err.stderr or err.stdout or "").splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"exit status {err.returncode}"
        raise UserError(f"`{' '.join(cmd)}` failed: {detail}") from None


def fetch_deb(package: str, cache_dir: Path) -> Path:
    """The package's .deb in `cache_dir`, downloaded with apt-get when not cached yet."""
    if not _PACKAGE.match(package):
        raise UserError(f"data.sources entry {package!r} is not a Debian package name (e.g. python3.11-doc)")
    cached = sorted(cache_dir.glob(f"{package}_*.deb"))
    if cached:
        return cached[-1]
    if shutil.which("apt-get") is None:
        raise UserError("apt-get is not available; data=docs needs a Debian/Ubuntu system with apt")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private dir first so a failed download never leaves a partial .deb in the cache.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        _run(["apt-get", "download", package], Path(tmp))
        debs = sorted(Path(tmp).glob(f"{package}_*.deb"))
        if not debs:
            raise UserError(f"`apt-get download {package}` produced no .deb file")
        target = cache_dir / debs[-1].name
        debs[-1].replace(target)
    return target


def read_documents(tree: Path) -> list[tuple[str, str]]:
    """(relative path, text) of each text file under `tree`, sorted; symlinks are skipped as duplicates."""
    out = []
    for path in sorted(tree.rglob("*")):
        if path.is_symlink() or not path.is_file() or not path.name.endswith(SUFFIXES):
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        out.append((str(path.relative_to(tree)), text.replace("\r\n", "\n")))
    return out


def load_debian_docs(packages: list[str], cache_dir: Path, progress: Callable[[str], None] | None) -> Corpus:
    docs, sources = [], []
    for package in packages:
        if progress:
            progress(f"docs: fetching {package}")
        deb = fetch_deb(package, cache_dir)
        sources.append(source_entry(deb.name, deb.read_bytes()))
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".extract-") as tmp:
            _run(["dpkg", "-x", str(deb), tmp], cache_dir)
            found = read_documents(Path(tmp))
        if not found:
            raise UserError(f"package {package} holds no {'/'.join(SUFFIXES)} files; pick a documentation package")
        docs.extend(text.strip("\n") + "\n" for _, text in found)
        if progress:
            progress(f"docs: {package}: {len(found)} files")
    return Corpus("docs", docs, sources)
