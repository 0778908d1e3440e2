"""The simulator's side of a declared schedule (`asyncpipe.schedules`): each parameter's delay where a schedule
reads one version per stage and batch (`param_delays`), and, where forward and backward may read different
versions (PACI), the stages run apart, one micro-batch at a time, exactly as the pipeline engine runs them
(`StagedStaleness`).

`StagedStaleness` cuts the model where the pipeline does (`asyncpipe.model.partition`) and keeps, per stage, the
version before the latest (the simulator's memory, not the schedule's). A micro-batch's forward runs stage by
stage on each stage's declared forward version; on a stage whose backward version differs (a straddler) it runs
as the schedule's recipe says. ``inplace`` (`asyncpipe.schedules.paci`): the forward runs on W(v-1)'s values
copied into the parameters themselves, under `keep_saved_tensors`, and W(v) is copied back in place afterwards,
as the pipeline's in-place step does, so the backward through that graph reads W(v) wherever it saved a weight.
``recompute`` (`asyncpipe.schedules.paci_recompute`): the forward runs without a graph and is recomputed on W(v)
from the saved stage input before the backward.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from asyncpipe.model.partition import layer_of_param, partition
from asyncpipe.runtime.previous import values_in_place
from asyncpipe.runtime.saved import keep_saved_tensors
from asyncpipe.schedules import ScheduleSpec, staged


def stage_cut(model: nn.Module, stages: int, blocks: Optional[list[int]] = None) -> list[int]:
    """Stage boundaries over ``model.layers`` (the pipeline's: ``blocks`` per stage, `partition.cut_blocks`)."""
    return partition(len(model.layers), stages, blocks)  # type: ignore[arg-type]


def stage_params(model: nn.Module, stages: int, blocks: Optional[list[int]] = None) -> list[list[nn.Parameter]]:
    """Each stage's parameters under the cut, a parameter shared by two stages (a tied matrix) counted once, on the
    first: the groups per-stage clipping (`pipeline.clip=stage`) takes its norms over."""
    parts, layers = stage_cut(model, stages, blocks), list(model.layers)  # type: ignore[arg-type]
    seen: set[int] = set()
    groups: list[list[nn.Parameter]] = [[] for _ in range(stages)]
    for s in range(stages):
        for layer in layers[parts[s] : parts[s + 1]]:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    groups[s].append(p)
    return groups


def param_delays(
    model: nn.Module, spec: ScheduleSpec, stages: int, delay: int, blocks: Optional[list[int]] = None
) -> dict[str, int]:
    """Each parameter's steps of staleness under a schedule with one version per stage and batch."""
    assert spec.stage_delay is not None
    named = [n for n, _ in model.named_parameters()]
    if not staged(spec, stages, delay):
        return {n: spec.stage_delay(stages, 0, delay) for n in named}
    parts = stage_cut(model, stages, blocks)
    stage_of = [s for s in range(stages) for _ in range(parts[s], parts[s + 1])]
    return {n: spec.stage_delay(stages, stage_of[layer_of_param(n)], delay) for n in named}


class StagedStaleness:
    """Runs a batch's micro-batches through the stages of ``model`` on the versions ``spec`` declares."""

    def __init__(
        self, model: nn.Module, spec: ScheduleSpec, stages: int, micro_batches: int, blocks: Optional[list[int]] = None
    ) -> None:
        if not spec.straddle:
            raise ValueError(f"schedule {spec.name}: forward and backward versions differ only with a straddle recipe")
        parts = stage_cut(model, stages, blocks)
        layers = list(model.layers)  # type: ignore[arg-type]
        self.spec, self.P, self.m = spec, stages, micro_batches
        self.stages = [layers[parts[s] : parts[s + 1]] for s in range(stages)]
        self.params = [[p for layer in st for p in layer.parameters()] for st in self.stages]
        self.previous = [[p.detach().clone() for p in ps] for ps in self.params]  # W(v-1); W(-1) = W(0)
        self.version = 0  # updates applied so far (every stage steps once per batch)
        self.straddled = 0  # (micro-batch, stage) pairs whose forward read an older version than their backward

    def stage_params(self) -> list[list[nn.Parameter]]:
        return self.params

    @contextlib.contextmanager
    def _at(self, stage: int, version: int) -> Iterator[None]:
        if version == self.version:
            yield
            return
        if version != self.version - 1:
            raise RuntimeError(f"stage {stage}: W{version} asked for, W{self.version - 1} and W{self.version} kept")
        params, old = self.params[stage], self.previous[stage]
        current = [p.data for p in params]
        for p, t in zip(params, old):
            p.data = t
        try:
            yield
        finally:
            for p, t in zip(params, current):
                p.data = t

    @contextlib.contextmanager
    def _in_place_at(self, stage: int, version: int) -> Iterator[None]:
        """The block runs on W(version)'s values in the stage's own parameter storage; then the latest values
        go back into the same storage (what the pipeline's in-place step does between a forward and its backward)."""
        if version != self.version - 1:
            raise RuntimeError(f"stage {stage}: W{version} asked for in place, the stage holds W{self.version}")
        with values_in_place(self.params[stage], self.previous[stage]), keep_saved_tensors():
            yield

    def _run(self, stage: int, h: torch.Tensor) -> torch.Tensor:
        for layer in self.stages[stage]:
            h = layer(h)
        return h

    def micro_batch(
        self, k: int, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, autocast: Callable[[], Any]
    ) -> float:
        """Forward and backward of micro-batch ``k`` (numbered over the run); gradients accumulate (loss / m)."""
        P = self.P
        versions = [self.spec.versions(P, self.m, s, k) for s in range(P)]
        inputs: list[torch.Tensor] = []
        outputs: list[Any] = []
        h = x
        loss = None
        for s, (fwd, bwd) in enumerate(versions):
            inp = h if s == 0 else h.detach().requires_grad_(True)
            inplace = fwd != bwd and self.spec.inplace
            keep = fwd == bwd or inplace  # a straddler's graph is recomputed (none built) or kept (in place)
            at = self._in_place_at(s, fwd) if inplace else self._at(s, fwd)
            with at, torch.set_grad_enabled(keep), autocast():
                out = self._run(s, inp)
                if s == P - 1:
                    loss = loss_fn(out, y)
            inputs.append(inp)
            outputs.append(loss if s == P - 1 else out)
            h = out
        assert loss is not None
        value = float(loss.detach())
        grad = None
        for s in reversed(range(P)):
            fwd, bwd = versions[s]
            if bwd != self.version:
                raise RuntimeError(
                    f"stage {s}: micro-batch {k}'s backward reads W{bwd}, the stage holds W{self.version}"
                )
            out = outputs[s]
            if fwd != bwd:
                self.straddled += 1
            if fwd != bwd and self.spec.recompute:
                with autocast():
                    out = self._run(s, inputs[s])
                    if s == P - 1:
                        out = loss_fn(out, y)
            if s == P - 1:
                (out / self.m).backward()
            else:
                out.backward(grad)
            grad = inputs[s].grad if s > 0 else None
        return value

    @torch.no_grad()
    def before_step(self) -> None:
        """Keep W(v) as the previous version: the next batch's first forwards may read it."""
        for ps, old in zip(self.params, self.previous):
            torch._foreach_copy_(old, [p.detach() for p in ps])

    def after_step(self) -> None:
        self.version += 1

    def state_dict(self) -> dict:
        return {"version": self.version, "previous": [list(t) for t in self.previous]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        for old, saved in zip(self.previous, state["previous"]):
            for t, s in zip(old, saved):
                t.copy_(s)
