"""`TorchPipeliningEngine` (`engine=pipeline` with `pipeline.torch_schedule=NAME`): this rank's chunks of the model
run by one of PyTorch's own pipeline schedules (`torch.distributed.pipelining`: 1F1B, interleaved 1F1B, looped
BFS, interleaved zero bubble, ZBV, DualPipeV; `asyncpipe.torch_schedules`), as an engine of the run's
trainer, so that `bench pipeline` can run them beside DeepSpeed's engine on the same terms.

Same model (layers built from (seed, index) as the DeepSpeed engine builds them), same cut (one chunk per rank: DeepSpeed's
stages exactly; two chunks per rank: the same cut into 2P chunks), same micro-batches in the same order, same loss
(mean over micro-batches: torch scales the gradients by 1/m), and the same update as every other engine: the
per-tensor gradient norms of all chunks all-reduced in model order, then `asyncpipe.optim`'s clipping, lr schedule
and optimizer step. One replica (pipeline.data_parallel=1); synchronous only (delay 0).

Timing, as the DeepSpeed engine reports it: compute is the time inside this rank's forward / backward (input and
weight) chunks and its optimizer step; the rest of a step is waiting (communication, bubbles).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as tdist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from asyncpipe.data import MicroBatches
from asyncpipe.dist import Comm
from asyncpipe.partition import cut_blocks
from asyncpipe.torch_schedules import chunk_layers, rank_chunks, spec
from asyncpipe.model import build_layers, lm_loss, set_aux_grad_scale
from asyncpipe.model.compile import compile_modules, wanted
from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.optim import apply_update, build_optimizer, grad_sq_norm
from asyncpipe.engines.pipeline import memory
from asyncpipe.engines.pipeline.actmem import ActivationMeter
from asyncpipe.engines.pipeline.faults import CutControl
from asyncpipe.engines.pipeline.metrics import StepReporter
from asyncpipe.engines.pipeline.tied import TiedGrads
from asyncpipe.registry import describe
from asyncpipe.runtime.device import autocast_context
from asyncpipe.runtime.protocol import Agreement, Setup


class _Layers(nn.Module):
    """This rank's layers under their global indices, as DeepSpeed's `PipelineModule` names them ("3.attn...")."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, layer in sorted(layers.items()):
            self.add_module(str(i), layer)


class _TimedStage(PipelineStage):
    """A `PipelineStage` that books the seconds of its forward and backward chunks and meters the activations
    each forward keeps for its backward (`asyncpipe.engines.pipeline.actmem`)."""

    def attach(self, clock: dict, meter: ActivationMeter) -> None:
        self.clock, self.meter = clock, meter

    def _timed(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - began
            self.clock["compute"] += spent
            self.clock["by_op"][op] = self.clock["by_op"].get(op, 0.0) + spent

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.meter.forward((self.stage_index, fwd_chunk_id)):
            return self._timed("ForwardPass", super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = self._timed("BackwardPass", super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)
        if kwargs.get("full_backward", True):
            self.meter.backward_done((self.stage_index, bwd_chunk_id))
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = self._timed("BackwardPass", super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)
        self.meter.backward_done((self.stage_index, bwd_chunk_id))
        return out


class TorchPipeliningEngine:
    """One rank of a `torch.distributed.pipelining` schedule, as the trainer's engine (one replica)."""

    def __init__(self, cfg: DictConfig, setup: Setup) -> None:
        self.cfg = cfg
        t, p = cfg.train, cfg.pipeline
        self.sched = spec(p.torch_schedule)
        self.rank, self.world, self.device = setup.rank, setup.world, setup.device
        P, m = p.stages, t.micro_batches
        self.m, self.stages = m, P
        n_total = cfg.model.n_layer + 2
        per_chunk = chunk_layers(self.sched, n_total, P, cut_blocks(cfg, P * self.sched.chunks))  # pipeline.cut
        self.chunks = rank_chunks(self.sched, P, self.rank)
        self.memory_baseline = memory.mark(setup.device)
        mine = sorted(i for c in self.chunks for i in per_chunk[c])
        built = build_layers(cfg.model, setup.vocab_size, seed=cfg.seed, indices=mine)
        # train.compile: each layer in place, as the DeepSpeed engine does; torch refuses a compiled module under a
        # split backward (true is a config error there, auto stays eager).
        self.compiled = wanted(t.compile, setup.device, t.steps) and not self.sched.split_backward
        if self.compiled:
            compile_modules(built, t.compile_backend)
        self.module = _Layers({i: built[i] for i in mine}).to(setup.device)
        set_aux_grad_scale(self.module, 1.0 / m)
        self.optimizer = build_optimizer(self.module, cfg.optimizer, compensation=cfg.compensation, pipeline=True)
        self.clock: dict[str, Any] = {"compute": 0.0, "wait": 0.0, "norm_wait": 0.0, "by_op": {}, "blocked": {}}
        self.params = list(self.module.parameters())
        self.tied = TiedGrads.of_torch(self.params, self.module, self.sched, P, bool(cfg.model.tie_embeddings))
        self.meter = ActivationMeter(lambda: [*self.params, *self.module.buffers()])
        n = P * self.sched.chunks
        self.stage_objs = []
        for c in self.chunks:
            sub = nn.Sequential(*[built[i] for i in per_chunk[c]])
            stage = _TimedStage(sub, c, n, setup.device)
            stage.attach(self.clock, self.meter)
            self.stage_objs.append(stage)
        cls = getattr(torch_schedules, self.sched.cls)
        first = self.stage_objs[0] if self.sched.chunks == 1 else self.stage_objs
        self.schedule = cls(first, m, loss_fn=lm_loss, scale_grads=True)
        self.holds_input, self.holds_loss = 0 in self.chunks, n - 1 in self.chunks
        # Norms in model order: each rank's tensors at the global offset of its chunks' tensors.
        counts: list = [None] * self.world
        tdist.all_gather_object(
            counts, {c: self._chunk_params(per_chunk[c]) - (c == n - 1 and self.tied.is_copy) for c in self.chunks}
        )  # a tied copy: out of the norm list
        sizes = {c: k for d in counts for c, k in d.items()}
        self._offsets = {c: sum(sizes[x] for x in range(c)) for c in self.chunks}
        self._n_tensors = sum(sizes.values())
        self._per_chunk = per_chunk
        self._global_norm = p.clip == "global" and t.grad_clip > 0 and P > 1
        group = tdist.new_group(list(range(self.world)), backend="gloo")
        self.comm = Comm(self.world, group)
        self.control = CutControl(group, self.holds_loss)
        self.reporter = StepReporter(self.rank, self.world, tdist.new_group(list(range(self.world)), backend="gloo"))
        self._eval_group = tdist.new_group(list(range(self.world)), backend="gloo")
        self.train_data = MicroBatches(setup.data_dir, "train", t.seq_len, t.micro_batch_size, cfg.seed)
        self.tokens_per_step = t.micro_batch_size * m * t.seq_len
        self.lr_schedule = LRSchedule.of(t)  # the run's lr multiplier per step, as every engine's
        self.step = 0
        self.last_loss = math.nan
        self._walls: dict[int, float] = {}

    def _chunk_params(self, layers: list[int]) -> int:
        return sum(1 for i in layers for _ in getattr(self.module, str(i)).parameters())

    def describe(self) -> str:
        cfg, s = self.cfg, self.sched
        return (
            f"pipeline: PyTorch {s.cls} over {cfg.pipeline.stages} ranks x {s.chunks} chunk(s), {describe(cfg)}, "
            f"model {cfg.model.name}, {cfg.train.steps} steps x {self.tokens_per_step} tokens"
            f"{', compiled' if self.compiled else ''}"
        )

    # -- one batch ----------------------------------------------------------------------------------------
    def train_step(self, sync: bool = True, save: bool = False) -> None:
        t = self.cfg.train
        began = time.perf_counter()
        compute0 = self.clock["compute"]
        batch = [self.train_data.get(self.step * self.m + j) for j in range(self.m)]
        x = torch.cat([b[0] for b in batch]).to(self.device)
        y = torch.cat([b[1] for b in batch]).to(self.device)
        args = (x,) if self.holds_input else ()
        losses: list = []
        self.module.train()
        with autocast_context(self.device, self.cfg.precision):  # bf16 over fp32 weights where the others use it
            self.schedule.step(*args, target=y if self.holds_loss else None, losses=losses if self.holds_loss else None)
        if self.holds_loss:
            self.last_loss = float(torch.stack([v.detach().float() for v in losses]).mean())
        stepped = time.perf_counter()
        norm, stage_sq = self._update(t)
        self.clock["compute"] += time.perf_counter() - stepped - self._norm_wait_last
        wall = time.perf_counter() - began
        compute = self.clock["compute"] - compute0
        self.clock["wait"] += wall - compute
        self._walls[self.step] = wall
        self.reporter.send(
            self.step,
            {
                "step": self.step,
                "stage": self.rank,
                "replica": 0,
                "loss_sum": self.last_loss * self.m if self.holds_loss else math.nan,
                "loss_count": self.m if self.holds_loss else 0,
                "stage_sq_norm": stage_sq,
                "global_norm": norm if self._global_norm else math.nan,
                "lr": self.optimizer.param_groups[0]["lr"],
                "wait_s": wall - compute,
                "compute_s": compute,
                "norm_wait_s": self._norm_wait_last,
                "weight_bytes": self.param_bytes,
                "peak_weight_bytes": self.param_bytes,
                "update_sq": math.nan,
                "correction_sq": math.nan,
                "moe_lb_sum": 0.0,
                "moe_z_sum": 0.0,
                "moe_count": 0,
            },
        )
        self.step += 1

    def _update(self, t: Any) -> tuple[float, float]:
        """Clip by the model-wide norm (per-tensor norms placed in model order, all-reduced), then the step."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.tied.reduce(grads, lambda what: contextlib.nullcontext())  # a tied embedding's two gradients summed
        self.tied.wait(lambda what: contextlib.nullcontext())
        stage_sq = float(grad_sq_norm(self.params))
        self._norm_wait_last = 0.0
        if self._global_norm:
            everywhere = torch.zeros(self._n_tensors, dtype=torch.float32, device=grads[0].device)
            for c in self.chunks:
                ps = [
                    q
                    for i in self._per_chunk[c]
                    for q in getattr(self.module, str(i)).parameters()
                    if q is not self.tied.copy
                ]
                norms = torch._foreach_norm([q.grad for q in ps], 2, dtype=torch.float32)
                everywhere[self._offsets[c] : self._offsets[c] + len(ps)] = torch.stack(norms)
            waited = time.perf_counter()
            tdist.all_reduce(everywhere)
            self._norm_wait_last = time.perf_counter() - waited
            self.clock["norm_wait"] += self._norm_wait_last
            self.clock["blocked"]["norm_allreduce"] = self.clock["norm_wait"]
            total = grad_sq_norm([_Grad(v) for v in everywhere.unbind()]).sqrt()
        else:
            total = torch.tensor(stage_sq).sqrt()
        began = [0.0]

        def done() -> None:
            took = time.perf_counter() - began[0]
            self.clock["by_op"]["OptimizerStep"] = self.clock["by_op"].get("OptimizerStep", 0.0) + took

        # Synchronous (delay 0): nothing stale to compensate for.
        (norm,) = apply_update(
            self.optimizer,
            self.step,
            self.lr_schedule,
            t.grad_clip,
            [(self.params, total)],
            {},
            before_step=lambda: began.__setitem__(0, time.perf_counter()),
            after_step=done,
        )
        return norm, stage_sq

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    # -- the trainer's protocol ---------------------------------------------------------------------------
    def agree(self, stop: bool) -> Agreement:
        seen = self.control.exchange(stop, self.last_loss)
        return Agreement(seen.stop, seen.loss, self.step - 1)

    def settle(self) -> None:
        pass  # every step is applied when train_step returns

    def records(self, synced: bool) -> list[dict]:
        return self.reporter.collect(self._walls, None if synced else self.step - 1 - self.reporter.LAG)

    def val_share(self, n: int) -> list[int]:
        return list(range(n))

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        """Collective: the mean loss over ``batches``, forward only, chunk by chunk in model order (activations
        passed between ranks on a group of their own); the same value on every rank."""
        self.module.eval()
        n = self.stages * self.sched.chunks
        owner = {c: r for r in range(self.world) for c in rank_chunks(self.sched, self.stages, r)}
        total = torch.zeros(1, dtype=torch.float64)
        for x, y in batches:
            h = x.to(self.device)
            for c in range(n):
                if owner[c] == self.rank:
                    if c > 0 and owner[c - 1] != self.rank:
                        h = self._recv_like(x, owner[c - 1])
                    with autocast_context(self.device, self.cfg.precision):
                        h = self.stage_objs[self.chunks.index(c)].submod(h)
                    if c == n - 1:
                        total += float(lm_loss(h, y.to(self.device)))
                    elif owner[c + 1] != self.rank:
                        tdist.send(h.float().contiguous().cpu(), dst=owner[c + 1], group=self._eval_group)
        tdist.broadcast(total, src=owner[n - 1], group=self._eval_group)
        self.module.train()
        return float(total) / max(1, len(batches))

    def _recv_like(self, x: torch.Tensor, src: int) -> torch.Tensor:
        buf = torch.empty(*x.shape, self.cfg.model.d_model, dtype=torch.float32)
        tdist.recv(buf, src=src, group=self._eval_group)
        return buf.to(self.device)

    def state_dict(self) -> dict:
        return {"step": self.step, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def finish(self) -> tuple[Agreement, dict]:
        seen = self.control.finish()
        tail = Agreement(seen.stop, seen.loss, self.step)
        c = self.clock
        summary = {
            "stage": self.rank,
            "replica": 0,
            "wait_s": c["wait"],
            "compute_s": c["compute"],
            "idle_frac": c["wait"] / (c["wait"] + c["compute"]) if c["wait"] + c["compute"] > 0 else 0.0,
            "param_bytes": self.param_bytes,
            "peak_weight_bytes": self.param_bytes,
            "weight_versions_peak": 1.0,
            "seconds_by_op": dict(c["by_op"]),
            "seconds_blocked_in": dict(c["blocked"]),
            "peak_mem_bytes": memory.peak_since(self.memory_baseline, self.device),
            "peak_activation_bytes": self.meter.peak_bytes,
            "activation_bytes_per_micro_batch": self.meter.max_micro_batch_bytes,
            "torch_schedule": self.sched.cls,
            "chunks": self.chunks,
            "cut_control_wait_s": self.control.wait_s,
            "cuts": self.control.cuts,
        }
        return tail, {"stages": self.comm.gather(summary)}


class _Grad:
    """A scalar dressed as a parameter, so `grad_sq_norm` reduces per-tensor norms as it reduces gradients."""

    def __init__(self, value: torch.Tensor) -> None:
        self.grad = value
