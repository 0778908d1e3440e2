"""Stale weights for delayed optimisation: W(t+1) = W(t) - U_t(g(W(t-k))), with k chosen per parameter.

`DelayedWeights` keeps exactly k copies of a parameter delayed by k steps in a ring buffer and swaps them into
the parameter by pointer (no copy) around the forward/backward; `delays_for` maps a delay profile to per-parameter
delays. The single-process simulator and the pipeline engine both use these, so they share one definition.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from asyncpipe.errors import UserError

PROFILES = ("uniform", "pipedream")


def delays_for(model: nn.Module, profile: str, delay: int, stages: int) -> dict[str, int]:
    """Per-parameter delay (keyed like ``model.named_parameters()``) for a delay profile.

    ``uniform``: every parameter is ``delay`` steps stale (PipeDream-2BW when delay=1).
    ``pipedream``: the layers pipeline stage s of P=``stages`` would own (see `asyncpipe.model.partition`) are
    P-1-s steps stale, as in the original PipeDream; ``delay`` is not used. Needs a ``model.layers`` list
    whose parameters are named ``layers.{i}.…``.
    """
    named = list(model.named_parameters())
    if profile == "uniform":
        if delay < 0:
            raise UserError(f"delay={delay} must be >= 0")
        return {name: delay for name, _ in named}
    if profile != "pipedream":
        raise UserError(f"delay_profile={profile} is not allowed; choose one of: {', '.join(PROFILES)}")
    from asyncpipe.model.partition import layer_of_param, partition

    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("delay_profile=pipedream needs a model with a `layers` list")
    try:
        parts = partition(len(layers), stages)
    except ValueError as err:
        raise UserError(f"delay_profile=pipedream with pipeline.stages={stages}: {err}") from err
    stage_of_layer = [s for s in range(stages) for _ in range(parts[s], parts[s + 1])]
    return {name: stages - 1 - stage_of_layer[layer_of_param(name)] for name, _ in named}


class DelayedWeights:
    """Ring buffers of past weights: a parameter with delay k keeps exactly k copies, W(t-k) ... W(t-1).

    Per optimizer step: run forward and backward inside ``with dw.stale():`` (the parameters then hold
    W(t-k), gradients land in ``p.grad`` as usual), then call ``dw.advance()`` after the backward and before
    the optimizer step. Before step k the stale weights are W(0).
    """

    def __init__(self, params: Sequence[nn.Parameter], delays: Sequence[int]) -> None:
        if len(params) != len(delays):
            raise ValueError(f"{len(params)} parameters but {len(delays)} delays")
        if any(k < 0 for k in delays):
            raise UserError(f"delays must be >= 0, got {sorted(set(delays))}")
        self.params = list(params)
        self.delays = [int(k) for k in delays]
        # Only delayed parameters get a ring; every slot starts as a copy of W(0).
        self._delayed = [i for i, k in enumerate(self.delays) if k > 0]
        self._rings: dict[int, list[torch.Tensor]] = {
            i: [self.params[i].detach().clone() for _ in range(self.delays[i])] for i in self._delayed
        }
        self.step = 0  # optimizer steps recorded so far: the next forward is step `step`
        self._swapped = False

    @property
    def n_copies(self) -> int:
        """Number of stored weight tensors (sum of the delays)."""
        return sum(len(ring) for ring in self._rings.values())

    @property
    def extra_bytes(self) -> int:
        """Memory held by the stored copies."""
        return sum(t.numel() * t.element_size() for ring in self._rings.values() for t in ring)

    def _slot(self, i: int) -> int:
        # Slot (t mod k) holds W(t-k) now and receives W(t) in advance().
        return self.step % self.delays[i]

    def _swap(self) -> None:
        with torch.no_grad():
            for i in self._delayed:
                p, ring, j = self.params[i], self._rings[i], self._slot(i)
                current = p.data
                p.data = ring[j]
                ring[j] = current

    @contextlib.contextmanager
    def stale(self) -> Iterator[None]:
        """Parameters hold their stale values W(t-k) inside the block (forward and backward both go here)."""
        if self._swapped:
            raise RuntimeError("DelayedWeights.stale() is not re-entrant")
        self._swap()
        self._swapped = True
        try:
            yield
        finally:
            self._swap()
            self._swapped = False

    @torch.no_grad()
    def advance(self) -> None:
        """Record the current weights W(t) into the oldest slot (one copy per delayed parameter)."""
        if self._swapped:
            raise RuntimeError("DelayedWeights.advance() must be called outside stale()")
        if self._delayed:
            dst = [self._rings[i][self._slot(i)] for i in self._delayed]
            src = [self.params[i].detach() for i in self._delayed]
            torch._foreach_copy_(dst, src)
        self.step += 1

    def stale_weights(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each parameter's W(t-k) (the parameter itself when k=0), valid between the backward and `advance`."""
        if self._swapped:
            raise RuntimeError("DelayedWeights.stale_weights() must be called outside stale()")
        stale = {p: p.detach() for p in self.params}
        for i in self._delayed:
            stale[self.params[i]] = self._rings[i][self._slot(i)]
        return stale

    def state_dict(self) -> dict[str, Any]:
        """Exact resume state: the step counter and each ring (references, not copies)."""
        if self._swapped:
            raise RuntimeError("DelayedWeights.state_dict() must be called outside stale()")
        return {"step": self.step, "delays": list(self.delays), "rings": {i: list(r) for i, r in self._rings.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._swapped:
            raise RuntimeError("DelayedWeights.load_state_dict() must be called outside stale()")
        if list(state["delays"]) != self.delays:
            raise UserError("checkpoint was written with different per-parameter delays (delay / delay_profile)")
        for i, ring in self._rings.items():
            for slot, saved in zip(ring, state["rings"][i]):
                slot.copy_(saved)
        self.step = int(state["step"])
