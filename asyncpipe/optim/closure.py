"""The torch.optim closure convention, once: re-evaluate the loss with gradients enabled (inside an optimizer's
no-grad `step`) and return it, or None without a closure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch


def evaluate_closure(closure: Optional[Callable[[], Any]]) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
