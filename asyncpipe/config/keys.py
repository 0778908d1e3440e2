"""Dotted keys: the one flattener of a config tree (``{"a": {"b": 1}}`` -> ``("a.b", 1)``) and its inverse lookup.
Takes OmegaConf nodes or plain dicts and lists (a recorded config.yaml); never imports torch."""

from __future__ import annotations

from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf


def leaves(node: Any, prefix: str = "", index_lists: bool = False) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf under ``node``. A list is one leaf (as a plain list), or with
    ``index_lists`` its items are leaves ``key.0``, ``key.1``, ... (nested ones flattened too)."""
    if isinstance(node, (DictConfig, dict)):
        for key, value in node.items():
            yield from _below(value, f"{prefix}{key}", index_lists)
    elif isinstance(node, (ListConfig, list)) and index_lists:
        for i, value in enumerate(node):
            yield from _below(value, f"{prefix}{i}", index_lists)
    elif prefix:
        yield prefix.rstrip("."), node


def _below(value: Any, key: str, index_lists: bool) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (DictConfig, dict)) or (index_lists and isinstance(value, (ListConfig, list))):
        yield from leaves(value, key + ".", index_lists)
    elif isinstance(value, ListConfig):
        yield key, OmegaConf.to_container(value)
    else:
        yield key, value


def flatten(node: Any, index_lists: bool = False) -> dict[str, Any]:
    """``dict(leaves(node))``."""
    return dict(leaves(node, index_lists=index_lists))


def lookup(node: Any, dotted: str) -> Any:
    """The value at ``dotted`` in a nested dict / config node, or None where a part is missing."""
    for part in dotted.split("."):
        if not isinstance(node, (DictConfig, dict)) or part not in node:
            return None
        node = node[part]
    return node


def frozen(value: Any) -> Any:
    """A list as a tuple (its nested dicts and lists as their repr), so values of flattened configs can be compared
    and hashed; anything else as it is."""
    if isinstance(value, list):
        return tuple(repr(v) if isinstance(v, (dict, list)) else v for v in value)
    return value
