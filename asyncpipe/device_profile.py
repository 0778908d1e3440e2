"""Device profiles (`conf/device_profile/NAME.yaml`): a small YAML of stated device figures, and the per-layer
forward / backward seconds they give a model's layer list. Torch-free and below the cost model: the cost model
(`asyncpipe.timelines.cost_source.from_profile`) and per-layer stand-in compute (`asyncpipe.standin_costs`) both
price layers here, so the two cannot disagree on what a layer costs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncpipe.errors import UserError

PROFILE_DIR = Path(__file__).resolve().parents[1] / "conf" / "device_profile"
PROFILE_KEYS = (
    "name",
    "measured",
    "note",
    "matmul_flops",
    "efficiency",
    "backward_over_forward",
    "memory_bytes_per_s",
    "step_bytes_per_param",
    "ef_bytes_per_param",
    "p2p_bytes_per_s",
    "p2p_latency_s",
    "allreduce_bytes_per_s",
    "allreduce_latency_s",
    "overhead_s",
)


def named_yaml(name_or_path: str, folder: Path, setting: str, kind: str) -> Path:
    """``folder/NAME.yaml`` for a bare name, else the path itself; one line naming ``setting`` and the known names
    when there is no such file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = folder / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        raise UserError(f"{setting}: no such {kind}; give a YAML path or one of: {', '.join(known)}")
    return path


def load_profile(name_or_path: str) -> dict:
    """A device profile by name (conf/device_profile/NAME.yaml) or path; unknown keys or a missing one: one line."""
    from omegaconf import OmegaConf

    path = named_yaml(name_or_path, PROFILE_DIR, f"--profile {name_or_path}", "device profile")
    data = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(data, dict) or set(data) != set(PROFILE_KEYS):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise UserError(f"--profile {path}: a device profile has exactly the keys {', '.join(PROFILE_KEYS)}; got {got}")
    return data


def layer_seconds(profile: dict, m: Any, vocab: int, tokens: int, seq_len: int) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds per micro-batch of ``tokens`` tokens of each layer of ``[embedding, blocks,
    head]`` of the model config ``m`` under ``profile``: the layer's FLOPs (`asyncpipe.shapes.layer_flops`) over
    peak x efficiency; backward a stated multiple of forward."""
    from asyncpipe.shapes import layer_flops

    rate = float(profile["matmul_flops"]) * float(profile["efficiency"])
    fwd = [f * tokens / rate for f in layer_flops(m, vocab, seq_len)]
    return fwd, [f * float(profile["backward_over_forward"]) for f in fwd]
