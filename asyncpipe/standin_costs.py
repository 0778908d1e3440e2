"""Per-layer stand-in costs (`pipeline.standin.profile`, `pipeline.standin.scale`): each layer of the running model's
list ``[embedding, blocks, head]`` waits its own forward and backward seconds, taken from a stand-in profile
(`conf/standin/NAME.yaml` or a YAML path): a model preset priced by a device profile (`asyncpipe.device_profile`,
the cost model's own per-layer figures) at a stated micro-batch, times ``scale``. A stage then waits the sum over
the layers its cut gives it (the embedding and the head included), so an uneven cut has a measurable effect on a
tiny model whose real ops stay far below the waits. The running model's blocks each take the profile model's mean
block cost (every block of a dense preset costs the same), its embedding and head the profile's.
Torch-free, and below `asyncpipe.partition`, whose balanced cut weighs the layers by these seconds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from asyncpipe.errors import UserError

STANDIN_DIR = Path(__file__).resolve().parents[1] / "conf" / "standin"
MODEL_DIR = STANDIN_DIR.parent / "model"
STANDIN_KEYS = ("name", "note", "model", "vocab_size", "micro_batch_size", "seq_len", "device_profile")


def standin_node(cfg: Any) -> Any:
    return cfg.pipeline.get("standin") or {}


def profile_of(cfg: Any) -> Optional[str]:
    """The run's stand-in profile (None: per-layer stand-in compute is off)."""
    return standin_node(cfg).get("profile") or None


def load_standin(name_or_path: str) -> dict:
    """A stand-in profile by name (conf/standin/NAME.yaml) or path, its keys checked: one line when it is wrong."""
    from omegaconf import OmegaConf

    from asyncpipe.device_profile import named_yaml

    path = named_yaml(name_or_path, STANDIN_DIR, f"pipeline.standin.profile={name_or_path}", "stand-in profile")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # the YAML parser's many error types
        raise UserError(f"pipeline.standin.profile={path}: not a readable YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict) or set(data) != set(STANDIN_KEYS):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise UserError(
            f"pipeline.standin.profile={path}: a stand-in profile has exactly the keys {', '.join(STANDIN_KEYS)}; "
            f"got {got}"
        )
    for key in ("micro_batch_size", "seq_len"):
        if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 1:
            raise UserError(f"pipeline.standin.profile={path}: {key} = {data[key]!r} must be a whole number >= 1")
    return data


def _preset(name: str) -> Any:
    """The model preset conf/model/NAME.yaml over the schema's `ModelConfig` (its defaults fill the keys the YAML
    leaves out), as `shapes.layer_shapes` reads it: torch-free, no Hydra."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from asyncpipe.config.schema import ModelConfig

    path = MODEL_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))
        raise UserError(f"stand-in profile: model {name} is not a preset; one of: {', '.join(known)}")
    try:
        return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    except (yaml.YAMLError, OmegaConfBaseException) as exc:  # not YAML; an unknown key or a wrong type
        raise UserError(
            f"stand-in profile: model preset {path} does not read as a model config: {str(exc).splitlines()[0]}"
        ) from None


def profile_seconds(standin: dict) -> dict[str, tuple[float, float]]:
    """A stand-in profile's (forward, backward) seconds per micro-batch of one embedding, one block (their mean)
    and the head, unscaled."""
    from asyncpipe.device_profile import layer_seconds, load_profile
    from asyncpipe.shapes import layer_shapes

    m = _preset(str(standin["model"]))
    vocab = standin["vocab_size"] or m.vocab_size
    if not vocab:
        raise UserError(f"stand-in profile {standin['name']}: model {m.name} names no vocabulary; give vocab_size")
    seq, tokens = int(standin["seq_len"]), int(standin["micro_batch_size"]) * int(standin["seq_len"])
    fwd, bwd = layer_seconds(load_profile(str(standin["device_profile"])), m, int(vocab), tokens, seq)
    kinds = [x.kind for x in layer_shapes(m, int(vocab))]

    def mean(xs: list[float], kind: str) -> float:
        mine = [x for x, k in zip(xs, kinds) if k == kind]
        return sum(mine) / len(mine)

    return {k: (mean(fwd, k), mean(bwd, k)) for k in ("embedding", "block", "head")}


def layer_costs(cfg: Any) -> Optional[tuple[list[float], list[float]]]:
    """(forward, backward) stand-in seconds per micro-batch of every layer of ``cfg``'s model, scaled; None when
    the run has no stand-in profile."""
    name = profile_of(cfg)
    if name is None:
        return None
    per = profile_seconds(load_standin(str(name)))
    scale = float(standin_node(cfg).get("scale", 1.0))
    kinds = ["embedding"] + ["block"] * int(cfg.model.n_layer) + ["head"]
    return [per[k][0] * scale for k in kinds], [per[k][1] * scale for k in kinds]


def standin_problem(cfg: Any) -> str:
    """Why ``cfg``'s per-layer stand-in settings cannot run ('' when they can, or are off): one line."""
    node = standin_node(cfg)
    scale = node.get("scale", 1.0)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or not 0 < scale <= 1000:
        return f"pipeline.standin.scale={scale} must be a number in (0, 1000]"
    if profile_of(cfg) is None:
        return ""
    if any(float(node.get(k, 0.0)) > 0 for k in ("forward_s", "backward_s")):
        return (
            "pipeline.standin: give either a profile (each layer its own seconds) or forward_s / backward_s "
            "(one figure per stage), not both"
        )
    try:
        fwd, bwd = layer_costs(cfg) or ([], [])
    except UserError as err:
        return str(err)
    if max(fwd + bwd, default=0.0) > 60:
        return f"pipeline.standin: profile {profile_of(cfg)} x scale {scale} makes a layer wait over 60 s"
    return ""
