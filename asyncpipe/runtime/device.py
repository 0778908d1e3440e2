"""Device, precision and vocabulary decisions shared by the simulator and the pipeline stages."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from asyncpipe.errors import UserError


def pick_device(name: str) -> torch.device:
    """`auto` = CUDA when present, else CPU; `cuda` without a GPU is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    return torch.device(name)


def use_bf16(device: torch.device, precision: str) -> bool:
    """bf16 autocast when asked for, or with precision=auto on CUDA."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast_context(device: torch.device, precision: str) -> ContextManager:
    """bf16 autocast over fp32 master weights (auto: on CUDA only); fp32 otherwise."""
    if not use_bf16(device, precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def vocab_size_for(model_cfg: Any, manifest: dict) -> int:
    """The model's vocabulary: its own size when set (presets), else the tokenizer's; never smaller than it."""
    tok_vocab = int(manifest["tokenizer"]["vocab_size"])
    if model_cfg.vocab_size is None:
        return tok_vocab
    if model_cfg.vocab_size < tok_vocab:
        raise UserError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {tok_vocab} ids; "
            "raise it or set model.vocab_size=null"
        )
    return int(model_cfg.vocab_size)
