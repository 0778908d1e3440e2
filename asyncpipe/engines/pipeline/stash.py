"""Two weight versions per pipeline stage (PipeDream-2BW's double buffering), swapped in by reference.

Each parameter has a stable optimizer handle P (the module's own `nn.Parameter`, which the optimizer and its
state are keyed by) and, with delay 1, two version slots: separate `nn.Parameter` objects whose storages hold
W(v) for the two live versions v. A forward runs with the module's parameters pointed at its micro-batch's slot,
so autograd saves that slot and the backward sees the forward-time weights however the optimizer moves on.
The step W(v+1) = W(v) - U copies slot v into the free slot, points P's storage at it and steps in place:
two weight copies per stage, and the optimizer never writes a tensor an in-flight backward still needs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn


class WeightStash:
    """Weight versions of one stage's ``module`` for a 0- or 1-step delay.

    Protocol per micro-batch: ``with stash.use(v): forward`` then, after its backward, ``stash.release(v)``.
    Per batch: ``take_grads(v)`` after its last backward, then ``begin_update(src, dst)``, the optimizer step on
    `params`, ``end_update(dst)``. With delay 0 there is one version, the module's own parameters.
    """

    def __init__(self, module: nn.Module, delay: int) -> None:
        if delay not in (0, 1):
            raise ValueError(f"the pipeline stash holds delay 0 or 1, got {delay}")
        self.module, self.delay = module, delay
        # (owner module, attribute name, P) for every parameter, so a slot can be swapped in per module.
        self._owners = [
            (mod, name, p) for mod in module.modules() for name, p in mod._parameters.items() if p is not None
        ]
        self.params: list[nn.Parameter] = [p for _, _, p in self._owners]
        if delay:
            # Slot 0 shares P's storage: W(0) is not copied until the first step makes W(1).
            self.slots: list[Optional[list[nn.Parameter]]] = [
                [nn.Parameter(p.data, requires_grad=p.requires_grad) for p in self.params],
                None,
            ]
        else:
            self.slots = [self.params]
        self.slot_version: list[Optional[int]] = [0, None]
        self.latest = 0
        self.in_flight: dict[int, int] = {}  # version -> micro-batches forwarded but not yet backwarded
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.peak_bytes = self.weight_bytes

    # -- bookkeeping ----------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of weight storage this stage holds now (one or two versions)."""
        return self.param_bytes * sum(s is not None for s in self.slots)

    @property
    def versions_alive(self) -> set[int]:
        """Versions still needed: the latest (the base of the next update) and any used by in-flight work."""
        return {self.latest} | {v for v, n in self.in_flight.items() if n > 0}

    def _slot(self, version: int) -> int:
        slot = version % 2 if self.delay else 0
        if self.delay and self.slot_version[slot] != version:
            raise RuntimeError(f"weight version {version} is not stashed (slots hold {self.slot_version})")
        return slot

    # -- per micro-batch ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def use(self, version: int) -> Iterator[None]:
        """Run the block (a forward) on W(version); the micro-batch then counts as in flight on it."""
        if not self.delay and version != self.latest:
            raise RuntimeError(f"delay 0 has only the latest version {self.latest}, asked for {version}")
        slot = self.slots[self._slot(version)]
        assert slot is not None
        if self.delay:
            for (mod, name, _), v in zip(self._owners, slot):
                mod._parameters[name] = v
        try:
            yield
        finally:
            if self.delay:
                for mod, name, p in self._owners:
                    mod._parameters[name] = p
        self.in_flight[version] = self.in_flight.get(version, 0) + 1

    def release(self, version: int) -> None:
        """The backward of one micro-batch on ``version`` is done."""
        if self.in_flight.get(version, 0) <= 0:
            raise RuntimeError(f"release of version {version} with no micro-batch in flight on it")
        self.in_flight[version] -= 1

    def weights(self, version: int) -> list[torch.Tensor]:
        """The stored tensors of W(version), in `params` order (the handles themselves with delay 0)."""
        slot = self.slots[self._slot(version)]
        assert slot is not None
        return [v.detach() for v in slot]

    # -- per batch -------------------------------------------------------------------------------------
    def take_grads(self, version: int) -> list[torch.Tensor]:
        """Detach the accumulated gradients of the micro-batches that ran on ``version`` (zeros where none),
        so the next batch accumulates into fresh tensors even when it runs on the same version."""
        slot = self.slots[self._slot(version)]
        assert slot is not None
        grads = []
        for v in slot:
            grads.append(v.grad if v.grad is not None else torch.zeros_like(v))
            v.grad = None
        return grads

    @torch.no_grad()
    def begin_update(self, src: int, dst: int) -> None:
        """Point the optimizer handles at a fresh copy of W(src) that will become W(dst) in place."""
        if src != self.latest or dst != src + 1:
            raise RuntimeError(f"update {src}->{dst} but the latest version is {self.latest}")
        if not self.delay:
            return
        dst_slot = dst % 2
        old = self.slot_version[dst_slot]
        if old is not None and self.in_flight.get(old, 0) > 0:
            raise RuntimeError(
                f"version {old} is still used by {self.in_flight[old]} micro-batches; cannot overwrite it"
            )
        src_params = self.slots[self._slot(src)]
        assert src_params is not None
        if self.slots[dst_slot] is None:
            self.slots[dst_slot] = [
                nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad) for p in src_params
            ]
            self.peak_bytes = max(self.peak_bytes, self.weight_bytes)
        dst_params = self.slots[dst_slot]
        assert dst_params is not None
        torch._foreach_copy_([v.data for v in dst_params], [v.data for v in src_params])
        for p, v in zip(self.params, dst_params):
            p.data = v.data  # the optimizer's in-place step now writes the free slot
        self.slot_version[dst_slot] = None  # holds a half-made version until end_update

    def end_update(self, dst: int) -> None:
        self.latest = dst
        if self.delay:
            self.slot_version[dst % 2] = dst
        if self.in_flight.get(dst - 2, 0) == 0:
            self.in_flight.pop(dst - 2, None)

    # -- checkpoints: taken at a batch cut, where every optimizer step so far has been applied ------------
    def state_dict(self) -> dict:
        """The versions a resumed run needs: W(latest) and, with delay 1, W(latest-1), which the next batch
        runs on (in-flight micro-batches are not saved: a resumed stream recomputes them). The tensors are the
        live slots: serialize them before the next step."""
        wanted = [self.latest] if not self.delay else [v for v in (self.latest - 1, self.latest) if v >= 0]
        versions = {}
        for v in wanted:
            slot = self.slots[self._slot(v)]
            assert slot is not None
            versions[v] = [t.detach() for t in slot]
        return {"delay": self.delay, "latest": self.latest, "versions": versions}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore the versions of `state_dict` into this (fresh) stash; the optimizer handles end on the latest."""
        if state["delay"] != self.delay or self.latest != 0 or any(self.in_flight.values()):
            raise RuntimeError("load a stash state only into a fresh stash of the same delay")
        latest = int(state["latest"])
        for v, tensors in state["versions"].items():
            slot = v % 2 if self.delay else 0
            if self.slots[slot] is None:
                self.slots[slot] = [
                    nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad) for p in self.params
                ]
            params = self.slots[slot]
            assert params is not None
            if len(params) != len(tensors):
                raise RuntimeError(f"checkpoint holds {len(tensors)} tensors, this stage has {len(params)}")
            for p, t in zip(params, tensors):
                p.data.copy_(t)
            self.slot_version[slot] = v
        self.latest = latest
        self.in_flight = {}
        newest = self.slots[latest % 2 if self.delay else 0]
        assert newest is not None
        for p, v in zip(self.params, newest):
            p.data = v.data
        self.peak_bytes = max(self.peak_bytes, self.weight_bytes)
