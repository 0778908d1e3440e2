"""A best-effort Weights & Biases mirror of the local run files, and `sync` for offline runs.

W&B must never stop training: wandb is imported lazily, and any failure (missing package, failed
init, failed log) becomes one warning after which the mirror is a no-op. Only rank 0 talks to W&B.
"""

from __future__ import annotations

import copy

import netrc
import os
import secrets
import string
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from asyncpipe.errors import UserError
from asyncpipe.track.files import atomic_write_text

ID_FILE = "wandb_id.txt"
INIT_TIMEOUT_S = 30.0  # an unreachable server must not hold a run for the default 90 s
_SECRET_WORDS = ("key", "secret", "password", "passwd", "credential")
# "token" alone would also match tokenizer settings, so it only counts as a whole word (api_token, token).
_SECRET_WHOLE_WORDS = ("token", "auth")


def config_value(cfg: Any, dotted: str, default: Any = None) -> Any:
    """cfg.a.b.c of an OmegaConf node or a plain dict (`OmegaConf.select`); `default` when missing or null."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg or {})
    value = OmegaConf.select(node, dotted, default=None, throw_on_missing=False)
    return default if value is None else value


def has_api_key() -> bool:
    """True when W&B credentials are configured: WANDB_API_KEY, or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(mode: str) -> str:
    """The wandb.init mode for a configured mode (checked by `asyncpipe.config.validate`): auto/online fall
    back to offline without an API key."""
    if mode in ("offline", "disabled"):
        return mode
    env_mode = os.environ.get("WANDB_MODE", "").lower()
    if mode == "auto" and env_mode in ("offline", "disabled", "dryrun"):
        return "offline" if env_mode == "dryrun" else env_mode  # the user's W&B environment wins over auto
    if has_api_key():
        return "online"
    if mode == "online":
        warnings.warn(
            "tracker.wandb.mode=online but no W&B API key is configured (WANDB_API_KEY or ~/.netrc); "
            "logging offline instead (upload later with `wandb sync`)",
            RuntimeWarning,
            stacklevel=3,
        )
    return "offline"


def _is_secret_name(name: str) -> bool:
    lowered = str(name).lower()
    if any(word in lowered for word in _SECRET_WORDS):
        return True
    words = lowered.replace("-", "_").replace(".", "_").split("_")
    return any(word in _SECRET_WHOLE_WORDS for word in words)


def clean_config(cfg: Any) -> Any:
    """The config as plain containers (resolved when possible) without secret-looking keys or the API key."""
    if not isinstance(cfg, (dict, list)):
        from omegaconf import OmegaConf

        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # e.g. ${now:} outside Hydra: the unresolved text is still informative
            cfg = OmegaConf.to_container(cfg, resolve=False)
    secret = os.environ.get("WANDB_API_KEY") or None

    def scrub(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: scrub(v) for k, v in node.items() if not _is_secret_name(k)}
        if isinstance(node, list):
            return [scrub(v) for v in node]
        if secret and isinstance(node, str) and secret in node:
            return "<redacted>"
        return node

    return scrub(cfg)


def derive_tags(cfg: Any) -> list[str]:
    """Tags naming the run's axes (optimizer, delay, EF, model, engine) plus tracker.wandb.tags."""
    tags = []
    for label, dotted in (("opt", "optimizer.name"), ("delay", "delay"), ("model", "model.name"), ("engine", "engine")):
        value = config_value(cfg, dotted)
        if value is not None:
            tags.append(f"{label}:{value}")
    from asyncpipe.config.alias import resolve_switch

    plain = OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg or {})
    comp = config_value(resolve_switch(plain, strict=False), "compensation.name")  # an old record's EF switch too
    if comp is not None:
        tags.append("ef:on" if comp == "ef" else "ef:off")
    if comp not in (None, "none", "ef"):
        tags.append(f"comp:{comp}")
    tags.extend(str(t) for t in (config_value(cfg, "tracker.wandb.tags") or []))
    # W&B rejects tags longer than 64 characters; duplicates are noise.
    return list(dict.fromkeys(t[:64] for t in tags))


class WandbMirror:
    """Mirrors metrics and summary of one run into W&B; every method is a no-op once W&B has failed."""

    def __init__(
        self,
        cfg: Any,
        run_dir: str | os.PathLike,
        rank: int = 0,
        *,
        name: str | None = None,
        job_type: str | None = None,
        init_timeout: float = INIT_TIMEOUT_S,
    ):
        self.run_dir = Path(run_dir)
        self.run: Any = None  # the wandb Run, or None when the mirror is off
        self.mode = "disabled"
        self._start_step = 0
        if rank != 0:
            return
        self.mode = resolve_mode(config_value(cfg, "tracker.wandb.mode", "auto"))
        if self.mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")  # wandb's terminal warnings read the env, not Settings
        try:
            import wandb
        except Exception as exc:  # not installed, or broken install
            self._disable(f"wandb could not be imported ({exc})")
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=config_value(cfg, "tracker.wandb.project", "asyncpipe"),
                entity=config_value(cfg, "tracker.wandb.entity"),
                group=config_value(cfg, "tracker.wandb.group"),
                tags=derive_tags(cfg),
                config=clean_config(cfg),
                name=name or config_value(cfg, "run.name") or self.run_dir.name,
                job_type=job_type,
                dir=str(self.run_dir),
                id=self._run_id(),
                resume="allow",
                mode=self.mode,
                reinit="create_new",  # a second run in this process (e.g. a report) must not end the first
                settings=wandb.Settings(init_timeout=init_timeout, silent=True),
            )
            # On an online resume W&B knows the last step; steps at or below it would be dropped noisily.
            self._start_step = int(getattr(self.run, "step", 0) or 0)
        except Exception as exc:
            self._disable(f"wandb.init failed ({type(exc).__name__}: {exc})")

    def _run_id(self) -> str:
        """The W&B run id kept in the run dir, so a resumed run continues the same W&B run."""
        path = self.run_dir / ID_FILE
        if path.exists():
            run_id = path.read_text().strip()
            if run_id:
                return run_id
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        atomic_write_text(path, run_id + "\n")
        return run_id

    @property
    def active(self) -> bool:
        return self.run is not None

    def _disable(self, reason: str) -> None:
        self.run = None
        warnings.warn(f"W&B mirror off: {reason}; local run files are unaffected", RuntimeWarning, stacklevel=3)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._disable(f"{what} failed ({type(exc).__name__}: {exc})")

    def log(self, metrics: dict, step: int) -> None:
        if self.run is None or step < self._start_step:
            return
        values = {k: v for k, v in metrics.items() if v is not None and k != "step"}
        self._call("wandb log", self.run.log, values, step=step)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self._call("wandb summary", self.run.summary.update, {k: v for k, v in values.items() if v is not None})

    def log_images(self, images: dict[str, str | os.PathLike], step: int | None = None) -> None:
        """Log image files (e.g. the report's plots) under the given names."""
        if self.run is None:
            return
        import wandb

        def log() -> None:
            self.run.log({name: wandb.Image(str(path)) for name, path in images.items()}, step=step)

        self._call("wandb image log", log)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None:
        """Log a table (e.g. the report's loss gaps)."""
        if self.run is None:
            return
        import wandb

        self._call("wandb table log", lambda: self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step))

    def log_files(self, paths: Iterable[str | os.PathLike]) -> None:
        """Upload files with the run (e.g. report.md, gaps.csv)."""
        for path in map(Path, paths):
            if self.run is None:
                return
            self._call("wandb save", self.run.save, str(path), base_path=str(path.parent), policy="now")

    def finish(self, exit_code: int = 0) -> None:
        run, self._start_step = self.run, 0
        self._call("wandb finish", run.finish if run else None, exit_code=exit_code)
        self.run = None


def sync(path: str | os.PathLike, timeout_s: float = 120.0, progress: Any = None) -> int:
    """Upload every offline W&B run under `path` (a sweep or run dir) with `wandb sync`, one run at a time, each
    bounded by `timeout_s` (an unreachable W&B server makes `wandb sync` retry for many minutes); `progress`
    gets one line per run. Returns how many were uploaded."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; pass a sweep or run directory")
    if not timeout_s > 0:
        raise UserError(f"--timeout {timeout_s} must be > 0 seconds")
    runs = sorted(p for p in root.rglob("offline-run-*") if p.is_dir() and p.parent.name == "wandb")
    if not runs:
        raise UserError(f"no offline W&B runs (*/wandb/offline-run-*) found under {root}")
    if not has_api_key():
        raise UserError("no W&B API key is configured; run `wandb login` or set WANDB_API_KEY, then sync again")
    say = progress or (lambda _line: None)
    for i, run in enumerate(runs):
        say(f"[{i + 1}/{len(runs)}] wandb sync {run}")
        safe = ["-P"] if sys.version_info >= (3, 11) else []  # never import from the working directory
        cmd = [sys.executable, *safe, "-m", "wandb", "sync", str(run)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(
                f"wandb sync of {run} did not finish in {timeout_s:g} s (is W&B reachable? check the network and "
                f"WANDB_BASE_URL); {i} of {len(runs)} runs were uploaded, run `asyncpipe sync` again to retry"
            ) from None
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"wandb sync failed for {run}: {tail[0]} (is an API key configured?)")
    return len(runs)
