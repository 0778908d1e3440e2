"""What a straddling forward saves for its backward (PACI's in-place recipe, `asyncpipe.schedules.paci`), in one
place for both engines.

Autograd saves, for a layer's backward, its inputs and its weight tensors; the weights it saves are the stage's
parameters themselves (or views of them), not copies. When the optimizer then steps those parameters in place, a
backward through the graph reads the new weights, and stock torch refuses it ("one of the variables needed for
gradient computation has been modified by an inplace operation"): each saved tensor carries the version it was
saved at. Under `keep_saved_tensors` every tensor the forward saves is packed as the tensor itself, so the backward
unpacks it as it is now, with no version check: activations as the forward left them (nothing writes those), the
weights as the latest in-place step left them. What a forward saves as a copy (an autocast cast of a weight)
keeps its forward-time values, as it would in the authors' patched torch.
"""

from __future__ import annotations

import torch


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def keep_saved_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Context manager for a forward whose backward may run after an in-place step of its weights."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)
