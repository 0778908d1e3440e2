"""Checkpoints that a run can trust: one part file per rank, a completion marker, atomic writes, pruning.

Layout: ``RUN/checkpoints/step_00000042/rank0.pt … rank{W-1}.pt`` plus ``COMPLETE`` (JSON), written by rank 0
only after every rank's part is on disk. A directory without the marker (a crash mid-save) or with a part that does
not read (a truncated file) is never resumed from: `load_latest` names it and falls back to the previous good one.

A checkpoint is untrusted input (shared scratch, a collaborator's tarball): the marker's fingerprint (plain JSON,
size-capped) is checked before any part is deserialised, and parts are read with ``torch.load(weights_only=True)``,
which builds tensors and plain containers only and never runs code from the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Collection, Optional

import torch

from asyncpipe.errors import UserError, WriteFailed, os_error_in
from asyncpipe.track.files import atomic_write_text, file_mode

FORMAT = "asyncpipe-checkpoint-v1"
MARKER = "COMPLETE"
MAX_MARKER_BYTES = 1 << 20  # a marker is a few hundred bytes of JSON


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def _atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save` to a temporary file, then renamed: a failed write (a full disk, `ulimit -f`) leaves no part and
    is a `WriteFailed` naming the file (torch's own error only says where its writer stopped)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp's 0600 would keep collaborators from resuming or evaluating the run
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        cause = os_error_in(err)
        if cause is not None and not isinstance(err, WriteFailed):
            raise WriteFailed(path, cause) from None
        raise


def save(
    run_dir: Path,
    step: int,
    state: dict,
    fingerprint: dict,
    rank: int = 0,
    world: int = 1,
    barrier: Optional[Callable[[], None]] = None,
    keep: int = 2,
    pinned: Collection[int] = (),
) -> Path:
    """Write this rank's part; rank 0 marks the checkpoint complete once all ranks have written (after `barrier`).
    Checkpoints at a ``pinned`` step are never pruned (where shorter runs branch off: `checkpoint.branches`)."""
    target = step_dir(run_dir, step)
    try:
        target.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save(
            {"format": FORMAT, "fingerprint": fingerprint, "rank": rank, "world": world, "state": state},
            target / f"rank{rank}.pt",
        )
    except BaseException:
        with contextlib.suppress(OSError):  # no empty step dir is left (another rank's part keeps it)
            target.rmdir()
        raise
    if barrier is not None:
        barrier()
    if rank == 0:
        marker = {"format": FORMAT, "step": step, "world": world, "fingerprint": fingerprint}
        atomic_write_text(target / MARKER, json.dumps(marker, indent=1))
        prune(run_dir, keep, pinned)
    if barrier is not None:
        barrier()
    return target


def _complete_dirs(run_dir: Path) -> list[Path]:
    root = checkpoints_root(run_dir)
    return sorted(root.glob("step_*")) if root.is_dir() else []


def step_of(path: Path) -> int:
    """The step of a checkpoint directory (``step_00000042`` -> 42; -1 for a name that holds no number)."""
    try:
        return int(Path(path).name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def prune(run_dir: Path, keep: int, pinned: Collection[int] = ()) -> None:
    """Keep the newest `keep` complete checkpoints and those at a `pinned` step; drop older complete and incomplete
    ones below them."""
    dirs = [d for d in _complete_dirs(run_dir) if step_of(d) not in set(pinned)]
    complete = [d for d in dirs if (d / MARKER).exists()]
    keep_set = set(complete[-keep:])
    newest_kept = min(keep_set) if keep_set else None
    for d in dirs:
        if d in keep_set or newest_kept is None or d > newest_kept:
            continue
        shutil.rmtree(d, ignore_errors=True)


class DamagedCheckpoint(UserError):
    """A checkpoint that cannot be read (a truncated or damaged part or marker): `load_latest` falls back past it."""


def first_sentence(text: str, limit: int = 300) -> str:
    """The first sentence of an error's text (torch's run on for lines), never cut mid-sentence below `limit`."""
    line = next((part.strip() for part in text.strip().splitlines() if part.strip()), "")
    head = line.split(". ", 1)[0].rstrip(".")
    return head if len(head) <= limit else head[: limit - 3].rsplit(" ", 1)[0] + "..."


def complete(d: Path, world: int) -> Optional[str]:
    """Why checkpoint dir `d` is incomplete (a crash mid-save), or None when its marker and every part exist; a
    complete one written by another number of processes is refused."""
    missing = [f"rank{r}.pt" for r in range(world) if not (d / f"rank{r}.pt").exists()]
    if not (d / MARKER).exists() or missing:
        return f"missing {', '.join(missing)}" if missing else "no completion marker"
    marker = read_marker(d)
    if marker.get("world") != world:
        raise UserError(
            f"checkpoint {d} was written by {marker.get('world')} processes, this run has {world}; "
            "resume with the same pipeline.stages x pipeline.data_parallel"
        )
    return None


def latest_complete(
    run_dir: Path, world: int = 1, log: Callable[[str], None] = print, at_most: Optional[int] = None
) -> Optional[Path]:
    """The newest checkpoint whose marker and every rank part exist (at step ``at_most`` or earlier, when given);
    incomplete newer ones are reported."""
    for d in reversed(_complete_dirs(run_dir)):
        if at_most is not None and step_of(d) > at_most:
            continue
        why = complete(d, world)
        if why is not None:
            log(f"checkpoint {d.name} is incomplete ({why}); falling back to an earlier one")
            continue
        return d
    return None


def load_latest(
    run_dir: Path,
    fingerprint: dict,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[Any], list] = lambda x: [x],
    log: Callable[[str], None] = print,
) -> tuple[Optional[Path], Optional[dict]]:
    """(path, this rank's state) of the newest checkpoint that is complete and reads on every rank (`gather`: every
    rank's object on every rank, `dist.Comm.gather`), or (None, None) when there is none. A newer incomplete or damaged
    one (a crash mid-save, a truncated part) is named and passed over; a checkpoint of another run is refused, and
    so are damaged ones with no readable one below them (resuming from step 0 would silently drop them)."""
    damaged: Optional[str] = None
    for d in reversed(_complete_dirs(run_dir)):
        state, error, refusal, why = None, None, None, None
        try:
            why = complete(d, world)
            if why is None:
                state = load(d, fingerprint, rank=rank)
        except DamagedCheckpoint as err:  # a truncated part, a damaged marker
            error = str(err)
        except UserError as err:  # another run's checkpoint: refused, never passed over
            refusal = str(err)
        said = gather((error, refusal))  # every rank takes the same collective, and learns every rank's answer
        refusal = next((r for _, r in said if r), None)
        error = next((e for e, _ in said if e), None)
        if refusal is not None:
            raise UserError(refusal)
        if error is not None:
            damaged = damaged or error
            log(f"checkpoint {d.name} cannot be used ({error}); falling back to an earlier one")
            continue
        if why is not None:  # the files on disk say so alike on every rank
            log(f"checkpoint {d.name} is incomplete ({why}); falling back to an earlier one")
            continue
        return d, state
    if damaged is not None:
        raise UserError(
            f"{damaged}; no earlier checkpoint can be resumed from: delete the damaged checkpoint to "
            "start the run again from step 0, or choose another run.dir"
        )
    return None, None


def read_marker(step_path: Path) -> dict:
    """A checkpoint's completion marker: a small JSON object, or one-line refusal (never a traceback, never a hang)."""
    path = Path(step_path) / MARKER
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        if path.stat().st_size > MAX_MARKER_BYTES:
            raise ValueError(f"larger than {MAX_MARKER_BYTES} bytes")
        marker = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} marker")
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(f"checkpoint marker {path} cannot be read ({exc})") from None
    return marker


def _check_fingerprint(where: Path, theirs: Any, ours: dict, ignore: Collection[str] = ()) -> None:
    if not isinstance(theirs, dict):
        raise UserError(f"checkpoint {where} has no fingerprint; it was not written by asyncpipe")
    theirs, ours = _canonical(theirs), _canonical(ours)
    diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k) and k not in ignore)
    if diff:
        detail = ", ".join(f"{k}: {theirs.get(k)!r} != {ours.get(k)!r}" for k in diff)
        raise UserError(f"checkpoint {where} belongs to a different run ({detail})")


def load(path: Path, fingerprint: dict, rank: int = 0, ignore: Collection[str] = ()) -> dict:
    """This rank's state from a complete checkpoint; refuses a corrupt file or one written for another setup (the
    fingerprint keys in ``ignore`` may differ: a budget branch loads a longer run's checkpoint, ``steps``).

    The marker's fingerprint is compared before the part is opened, and the part is read with weights_only=True:
    a hostile file can fail to load, never execute."""
    path = Path(path)
    _check_fingerprint(path / MARKER, read_marker(path).get("fingerprint"), fingerprint, ignore)
    part = path / f"rank{rank}.pt"
    if not part.is_file():
        raise DamagedCheckpoint(f"checkpoint part {part} is missing or not a regular file")
    try:
        blob = torch.load(part, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DamagedCheckpoint(
            f"checkpoint {part} cannot be read safely ({type(exc).__name__}: {first_sentence(str(exc))})"
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise DamagedCheckpoint(f"{part} is not an asyncpipe checkpoint")
    _check_fingerprint(part, blob.get("fingerprint"), fingerprint, ignore)
    return blob["state"]


def fingerprint_of(cfg: Any) -> dict:
    """What must match between a checkpoint and the run resuming it (anything else may change on resume). The
    compensation method is named as checkpoints have always named it: by each method's declared fingerprint key
    (``{key: whether this run runs it}``, in every fingerprint), else ``compensation`` (absent when none, so
    checkpoints from before that option match)."""
    flags = _fingerprint_keys()
    method = cfg.compensation.name
    fp = {
        "model": cfg.model.name,
        "shape": [cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head],
        "optimizer": cfg.optimizer.name,
        **{key: method == name for key, name in flags.items()},
        "delay": int(cfg.delay),
        "delay_profile": cfg.delay_profile,
        "engine": cfg.engine,
        "micro_batches": int(cfg.train.micro_batches),
        "micro_batch_size": int(cfg.train.micro_batch_size),
        "seq_len": int(cfg.train.seq_len),
        "steps": int(cfg.train.steps),
        "seed": int(cfg.seed),
        "data": f"{cfg.data.name}-{cfg.tokenizer.name}",
    }
    if method != "none" and method not in flags.values():
        fp["compensation"] = method
    return fp


def _fingerprint_keys() -> dict[str, str]:
    """The declared fingerprint keys (`asyncpipe.registry.MethodSpec.fingerprint_key`): key -> its method."""
    from asyncpipe.registry import methods

    return {m.fingerprint_key: m.name for m in methods() if m.fingerprint_key is not None}


def _canonical(fp: dict) -> dict:
    """A fingerprint with each method named one way: a checkpoint written with ``compensation=<method>`` for a
    method that declares a fingerprint key (before its switch became that method) recorded {key: False,
    "compensation": method}; it is {key: True} now."""
    by_method = {name: key for key, name in _fingerprint_keys().items()}
    named = fp.get("compensation")
    key = by_method.get(named) if isinstance(named, str) else None  # a damaged file's value may not be a name
    if key is None:
        return fp
    return {**{k: v for k, v in fp.items() if k != "compensation"}, key: True}
