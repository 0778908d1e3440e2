"""The simulator (`engine=simulate`): exact k-step delayed optimisation of the whole model in one process (or
D data-parallel replicas), as an engine of the run's trainer (`asyncpipe.runtime.protocol.Engine`).

One optimizer step = `train.micro_batches` micro-batches of gradient accumulation evaluated at the stale weights
W(t-k), global-norm clipping of that stale gradient, then the optimizer's update applied to W(t). The delay and EF
maths live in `asyncpipe.optim`; this file only orders the calls.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

from asyncpipe.data import MicroBatches
from asyncpipe.dist import Comm
from asyncpipe.model import GPT, count_parameters, lm_loss, pop_moe_stats, set_aux_grad_scale
from asyncpipe.model.compile import CompileClock, TrainingForward, compile_modules, wanted
from asyncpipe.optim import DelayedWeights, LRSchedule, apply_update, build_optimizer, forward_weights, set_lr
from asyncpipe.engines.staged import StagedStaleness, param_delays, stage_params
from asyncpipe.registry import describe
from asyncpipe.partition import cut_blocks
from asyncpipe.schedules import resolve, staged
from asyncpipe.runtime.device import autocast_context
from asyncpipe.runtime.protocol import Agreement, Setup


class StepResult:
    """One step's numbers, as its metrics record holds them. The loss, norms and diagnostics stay on the device
    until read: the first read of any (or the engine's next host read, see `SimulatorEngine`) moves every
    pending step's numbers to the host in one transfer."""

    def __init__(self, record: dict, read: Callable[[], None]) -> None:
        self._record, self._read = record, read

    def _get(self, key: str) -> Any:
        if any(torch.is_tensor(v) for v in self._record.values()):
            self._read()
        return self._record[key]

    step = property(lambda self: self._record["step"])
    lr = property(lambda self: self._record["lr"])
    step_time = property(lambda self: self._record["step_time"])
    train_loss = property(lambda self: self._get("train_loss"))
    grad_norm = property(lambda self: self._get("grad_norm"))

    @property
    def extras(self) -> dict:
        self._get("step")
        return {k: v for k, v in self._record.items() if k not in RECORD_KEYS}


RECORD_KEYS = ("step", "train_loss", "lr", "grad_norm", "step_time")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``: on CUDA through pinned memory, so the copy does not block the host."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SimulatorEngine:
    """Owns the model, optimizer, delayed weights and training stream of one simulated run, on the device and
    data the trainer set up (``setup``). Replicas agree on the loss inside `train_step` (one all-reduce with the
    gradients), so `agree` answers for the step just run. Built by `asyncpipe.trainer.Trainer`
    (``Trainer(cfg).engine`` for direct use: benchmarks, parity tests)."""

    def __init__(self, cfg: DictConfig, setup: Setup) -> None:
        self.cfg = cfg
        # Data-parallel replicas: replica r takes micro-batches r*m .. r*m+m-1 of each step's global batch, so
        # D replicas of m micro-batches see exactly what one process of D*m micro-batches sees.
        self.rank, self.world = setup.rank, setup.world
        self.log = setup.log
        self.device = setup.device
        torch.manual_seed(cfg.seed)
        self.vocab_size = setup.vocab_size
        t = cfg.train
        self.train_data = MicroBatches(setup.data_dir, "train", t.seq_len, t.micro_batch_size, cfg.seed)
        self.model = GPT(cfg.model, self.vocab_size, seed=cfg.seed).to(self.device)
        self.n_params = count_parameters(self.model)
        set_aux_grad_scale(self.model, 1.0 / t.micro_batches)  # MoE aux losses are scaled like the LM loss
        named = list(self.model.named_parameters())
        # The schedule's staleness (`asyncpipe.schedules`): one version per stage and batch (a delay per
        # parameter), or forward and backward versions per micro-batch and stage (the stages run apart).
        self.schedule = resolve(cfg)
        P = cfg.pipeline.stages
        self.staged: Optional[StagedStaleness] = None
        cut = cut_blocks(cfg, P) if staged(self.schedule, P, cfg.delay) else None  # the pipeline's (`pipeline.cut`)
        if self.schedule.stage_delay is None:
            self.staged = StagedStaleness(self.model, self.schedule, P, t.micro_batches, cut)
            delays = {name: int(cfg.delay) for name, _ in named}  # what the methods see, as in engine=pipeline
            stale = {name: 0 for name, _ in named}
        else:
            delays = stale = param_delays(self.model, self.schedule, P, cfg.delay, cut)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, compensation=cfg.compensation, delays=delays)
        self.params = [p for _, p in named]
        self.delayed = DelayedWeights(self.params, [stale[name] for name, _ in named])
        # Clipping per stage where the config asks for it (a schedule with no global step requires it), over the
        # pipeline's cut whatever the schedule's staleness: one norm per stage, as engine=pipeline takes them.
        self.clip_groups = [self.params]
        if cfg.pipeline.clip == "stage" and P > 1:
            self.clip_groups = (
                self.staged.stage_params() if self.staged else stage_params(self.model, P, cut_blocks(cfg, P))
            )
        # train.compile: the model with its loss, in place (the model's state dict unchanged; evaluation and
        # diagnostics call the model itself, eagerly); the first step pays the compile.
        self.train_forward = TrainingForward(self.model)
        self.clock = CompileClock(wanted(t.compile, self.device, t.steps))
        self.lr_schedule = LRSchedule.of(t)
        if self.clock.compiled:
            compile_modules([self.train_forward], t.compile_backend)
        self.step = 0
        self.tokens_per_step = t.micro_batch_size * t.micro_batches * t.seq_len * self.world
        # The replicas' control messages (stop flags, gathers): the default group on the CPU; on CUDA a gloo group
        # of their own, so agreeing on a flag each step never waits for the GPU (NCCL's object collectives do).
        control = None
        if self.world > 1 and self.device.type == "cuda":
            import torch.distributed as tdist

            control = tdist.new_group(list(range(self.world)), backend="gloo")
        self.comm = Comm(self.world, control)
        self._records: list[dict] = []  # steps not yet handed to the trainer, in order
        self._unread: list[dict] = []  # records whose device scalars the host has not read yet
        self._agreed: tuple[Optional[float], int] = (None, 0)  # the latest loss read on the host, and its step
        # How often the host reads the step's scalars (loss, norms): every step on the CPU, where reading costs
        # nothing; on CUDA once per logging interval (and at evaluations, checkpoints and the end), so the GPU's
        # queue stays full between. Divergence is then seen at the next read.
        self.read_every = 1 if self.device.type != "cuda" else max(1, int(cfg.train.log_every))

    # -- one optimizer step -------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> torch.Tensor:
        """Accumulate the step's mean-loss gradient at the current model weights; returns the mean loss (a float64
        scalar on the device, summed as Python floats would be: no host read per micro-batch)."""
        m = self.cfg.train.micro_batches
        first = (step * self.world + self.rank) * m
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for j in range(m):
            x, y = self.train_data.get(first + j)
            x, y = to_device(x, self.device), to_device(y, self.device)
            if self.staged is not None:
                # Numbered per replica, as each replica's pipeline numbers its own (PACI's a = m per replica).
                total += self.staged.micro_batch(
                    step * m + j, x, y, lm_loss, lambda: autocast_context(self.device, self.cfg.precision)
                )
                continue
            with autocast_context(self.device, self.cfg.precision):
                loss = self.train_forward(x, y)
            (loss / m).backward()
            total += loss.detach().double()
        return total / m

    def train_step(self, sync: bool = True, save: bool = False) -> StepResult:
        """One optimizer step (every step lands at once: ``sync`` is for engines that can defer)."""
        start = time.perf_counter()
        t = self.cfg.train
        set_lr(self.optimizer, self.lr_schedule, self.step)  # before the forward: weight prediction reads it
        with self.delayed.stale(), forward_weights(self.optimizer):
            loss = self.forward_backward(self.step)
        if self.world > 1:
            loss = self._average_replicas(loss)
        extras = pop_moe_stats(self.model)  # MoE: mean load-balancing and z-loss of this step ({} if dense)
        if self._diagnose_now():
            extras.update(self._fresh_grad_cosine())
            pop_moe_stats(self.model)  # the extra pass's router statistics are not this step's
        staged = self.staged

        def before_step() -> None:
            self.delayed.advance()
            if staged is not None:
                staged.before_step()

        norms = apply_update(
            self.optimizer,
            self.step,
            self.lr_schedule,
            t.grad_clip,
            [(g, None) for g in self.clip_groups],
            self.delayed.stale_weights(),
            before_step,
            staged.after_step if staged else None,
        )
        sq = norms[0].double() * norms[0].double()  # on the device, summed left to right as Python floats would be
        for n in norms[1:]:
            sq = sq + n.double() * n.double()
        grad_norm = sq.sqrt()
        for name in ("last_update_norm", "last_correction_norm"):
            value = getattr(self.optimizer, name, None)
            if value is not None:
                extras[name.removeprefix("last_")] = value
        extras.update(getattr(self.optimizer, "diagnostics", {}))
        self.step += 1
        lr = self.optimizer.param_groups[0]["lr"]
        took = time.perf_counter() - start
        if self.clock.compiled and self.clock.first is None:
            extras["compile_step"] = 1.0  # this step's time includes compiling: not a training-speed figure
        compile_s = self.clock.record(took)
        if compile_s is not None:
            self.log(f"torch.compile: {compile_s:.1f} s of compile in the first step (counted apart)")
        record = {"step": self.step, "train_loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": took, **extras}
        self._records.append(record)
        self._unread.append(record)
        if sync or self.step % self.read_every == 0 or self.step == t.steps:
            self.read()
        return StepResult(record, self.read)

    def read(self) -> None:
        """Move every unread step's device scalars to the host in one transfer (floats, as ``float(t)`` gives)."""
        todo = [(rec, k) for rec in self._unread for k, v in rec.items() if torch.is_tensor(v)]
        if todo:
            flat = torch.stack([rec[k].detach().reshape(()).to(self.device, torch.float64) for rec, k in todo])
            for (rec, k), value in zip(todo, flat.tolist()):
                rec[k] = value
        if self._unread:
            last = self._unread[-1]
            self._agreed = (last["train_loss"], last["step"])  # already the replicas' mean
        self._unread = []

    # -- what the trainer asks of an engine ---------------------------------------------------------------
    def agree(self, stop: bool) -> Agreement:
        """The stop flag of every replica, and the latest train loss the host has read (and its step)."""
        loss, step = self._agreed
        return Agreement(self.comm.any(stop), loss, step)

    def settle(self) -> None:
        """Nothing is ever pending here (the update of every step has landed)."""

    def records(self, synced: bool = False) -> list[dict]:
        """The steps read so far (``synced``: every step, read now)."""
        if synced:
            self.read()
        n = len(self._records) - len(self._unread)
        out, self._records = self._records[:n], self._records[n:]
        return out if self.rank == 0 else []

    def finish(self) -> tuple[Agreement, dict]:
        return Agreement(), self.clock.summary()

    def describe(self) -> str:
        cfg = self.cfg
        return (
            f"model {cfg.model.name} ({self.n_params / 1e6:.2f}M params, vocab {self.vocab_size}) | "
            f"{describe(cfg)} lr {cfg.optimizer.lr:g} | delay {cfg.delay} ({cfg.delay_profile}) | "
            f"{cfg.train.steps} steps x {self.tokens_per_step} tokens | {self.device.type}"
            f"{' compiled' if self.clock.compiled else ''}"
        )

    def _average_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean gradient and loss over replicas: one flat all-reduce, before clipping (as the pipeline does)."""
        import torch.distributed as tdist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat(
            [g.reshape(-1) for g in grads] + [torch.as_tensor(loss, device=self.device).reshape(1).to(grads[0].dtype)]
        )
        tdist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        return flat[-1].clone()  # not a view: the flat buffer is freed before the loss is read

    def _diagnose_now(self) -> bool:
        every = self.cfg.diagnostics.fresh_grad_every
        return every > 0 and self.cfg.delay > 0 and self.step % every == 0

    def _fresh_grad_cosine(self) -> dict:
        """Cosine between the stale gradient just computed and a fresh one at W(t) (one extra backward)."""
        stale = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(self.step)
        if self.world > 1:
            self._average_replicas(torch.zeros(()))
        fresh = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        dot = sum((a.double() * b.double()).sum() for a, b in zip(stale, fresh))
        na = math.sqrt(sum(float(a.double().pow(2).sum()) for a in stale))
        nb = math.sqrt(sum(float(b.double().pow(2).sum()) for b in fresh))
        for p, g in zip(self.params, stale):
            p.grad = g
        return {"fresh_grad_cos": float(dot) / max(na * nb, 1e-30)}

    # -- evaluation ---------------------------------------------------------------------------------------
    def val_share(self, n: int) -> list[int]:
        """Rank 0 evaluates every batch; the replicas hold the same weights, so the others evaluate none."""
        return list(range(n)) if self.rank == 0 else []

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        """Mean val loss over ``batches`` (rank 0's: `val_share`; NaN on the other replicas)."""
        if self.rank != 0:
            return math.nan
        self.model.eval()
        losses = []
        for x, y in batches:  # the model itself: eager in both modes (train.compile compiles `train_forward`)
            with autocast_context(self.device, self.cfg.precision):
                losses.append(lm_loss(self.model(to_device(x, self.device)), to_device(y, self.device)).item())
        self.model.train()
        return sum(losses) / len(losses)

    # -- checkpoint state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "delayed": self.delayed.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            **({"staged": self.staged.state_dict()} if self.staged is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.delayed.load_state_dict(state["delayed"])
        if self.staged is not None:
            self.staged.load_state_dict(state["staged"])
        torch.set_rng_state(state["rng"]["torch"])
