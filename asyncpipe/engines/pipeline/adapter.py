"""`PipelineEngineAdapter`: this rank's stage of an `engine=pipeline` run as an engine of the run's trainer
(`asyncpipe.runtime.protocol.Engine`), a thin adapter over `ScheduledPipelineEngine`. The trainer has set up the
device, the process group (DeepSpeed's comm included) and the data before it is built.

Data order matches the simulator: step t, replica r, micro-batch j reads global micro-batch t*m*D + r*m + j, so
P stages x D replicas with m micro-batches each equals `engine=simulate` with m*D micro-batches. Stop requests
and the train loss are agreed at batch cuts one batch late (`engines.pipeline.faults.CutControl`), so no rank ever waits
for them mid-stream; checkpoints are taken at cuts whose deferred steps are applied (`settle`).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import DictConfig

from asyncpipe.dist import Comm
from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.model.compile import CompileClock, eager, wanted
from asyncpipe.partition import cut_blocks
from asyncpipe.engines.pipeline.standin import stage_standin
from asyncpipe.registry import describe
from asyncpipe.registry import resolve as load_named
from asyncpipe.runtime.device import use_bf16
from asyncpipe.runtime.protocol import Agreement, Setup


def _train_stream(data: Any, m: int, replicas: int, replica: int, steps: int, start: int = 0) -> Iterator[tuple]:
    for t in range(start, steps):
        for j in range(m):
            yield data.get(t * m * replicas + replica * m + j)


def val_share(n: int, replicas: int, replica: int) -> list[int]:
    """The validation batches replica ``replica`` evaluates: equal shares keep "mean of replica means" equal to the
    simulator's mean; otherwise every replica does all ``n``."""
    return list(range(replica, n, replicas)) if n % replicas == 0 else list(range(n))


def build_deepspeed_engine(
    cfg: DictConfig, rank: int, device: Any, vocab: int, compiled: bool = False
) -> tuple[Any, int, int]:
    """This rank's `ScheduledPipelineEngine` over its stage of the model; returns (engine, stage, replica)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from asyncpipe.model import build_layers, lm_loss, set_aux_grad_scale, stage_layers
    from asyncpipe.optim import build_optimizer
    from asyncpipe.engines.pipeline import memory
    from asyncpipe.engines.pipeline.deepspeed_engine import ScheduledPipelineEngine
    from asyncpipe.engines.pipeline.stage import PipeSettings, StagedModule, deepspeed_config

    from asyncpipe.schedules import resolve

    t, p = cfg.train, cfg.pipeline
    spec = resolve(cfg)
    topo = PipeDataParallelTopology(num_pp=p.stages, num_dp=p.data_parallel)
    coord = topo.get_coord(rank)
    v_shape = spec.chunks == 2
    cut = cut_blocks(cfg, p.stages * spec.chunks)  # `pipeline.cut`, as plan and the cost model read it
    parts, mine = stage_layers(cfg.model.n_layer + 2, p.stages, coord.pipe, v_shape, cut)
    baseline = memory.mark(device)  # the stage's peak memory is measured from here (stage_summary)
    # Only this stage's layers are built, each from (seed, layer index): the simulator's initial weights.
    layers = build_layers(cfg.model, vocab, seed=cfg.seed, indices=mine)
    if compiled:  # train.compile: each of this stage's layers in place (state dict unchanged)
        from asyncpipe.model.compile import compile_modules

        compile_modules(layers, t.compile_backend)
    engine_cls: Any = load_named(spec.engine_class) if spec.engine_class else ScheduledPipelineEngine
    module_cls: Any = load_named(spec.module_class) if spec.module_class else StagedModule
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its seed and topology settings
        module = module_cls(layers, parts, topo, lm_loss)
    set_aux_grad_scale(module, 1.0 / t.micro_batches)  # MoE aux losses: scaled as DeepSpeed scales the LM loss
    optimizer = build_optimizer(module, cfg.optimizer, compensation=cfg.compensation, delays=cfg.delay, pipeline=True)
    ds_config = deepspeed_config(t.micro_batch_size, t.micro_batches, p.data_parallel, use_bf16(device, cfg.precision))
    settings = PipeSettings(
        schedule=spec.name,
        total_steps=t.steps,
        max_norm=t.grad_clip,
        clip=p.clip,
        lr_schedule=LRSchedule.of(t),
        trace=p.trace,
        defer_step=p.defer_step,
        standin=stage_standin(cfg, coord.pipe),  # pipeline.standin: per stage, or per chunk from a profile
        tied=bool(cfg.model.tie_embeddings) and spec.chunks == 1 and p.stages > 1,
    )
    mpu = module.mpu()
    engine = engine_cls(
        args=None,
        model=module,
        optimizer=optimizer,
        mpu=mpu,
        dist_init_required=False,
        config=ds_config,
        config_class=DeepSpeedConfig(ds_config, mpu),
        settings=settings,
    )
    engine.memory_baseline = baseline
    return engine, coord.pipe, coord.data


def cut_said(cfg: DictConfig, blocks: list[int]) -> str:
    """The start-up line's cut: ``blocks`` (per stage, per chunk in a V) and the rule that gave them
    (`pipeline.cut=balanced`), or the list, said to be the balanced cut within `pipeline.memory_gib` where it is that
    cut: `plan.budgeted` leaves only the list in the config, so the budget's cut is found again and compared."""
    p, listed = cfg.pipeline, ",".join(map(str, blocks))
    if isinstance(p.cut, str):
        return f"cut {listed} (pipeline.cut={p.cut})"
    budget = p.get("memory_gib")
    if budget is not None:
        import copy

        from asyncpipe.errors import ConfigError
        from asyncpipe.plan import cut_within

        balanced = copy.deepcopy(cfg)
        balanced.pipeline.cut = "balanced"
        with contextlib.suppress(ConfigError):  # no cut fits: the list is not the budget's
            if cut_within(balanced, strict=True)[0] == list(blocks):
                return f"pipeline.cut={listed} (balanced within pipeline.memory_gib={budget:g})"
    return f"pipeline.cut={listed}"


class PipelineEngineAdapter:
    """One rank's stage, as the trainer's engine: `train_step` runs one batch up to its cut."""

    def __init__(self, cfg: DictConfig, setup: Setup, run_dir: Optional[Path] = None) -> None:
        import torch.distributed as tdist

        from asyncpipe.data import MicroBatches
        from asyncpipe.engines.pipeline.faults import CutControl

        self.cfg, self.run_dir = cfg, run_dir
        self.rank, self.world = setup.rank, setup.world
        t, p = cfg.train, cfg.pipeline
        self.clock = CompileClock(wanted(t.compile, setup.device, t.steps))
        self.engine, self.stage, self.replica = build_deepspeed_engine(
            cfg, self.rank, setup.device, setup.vocab_size, self.clock.compiled
        )
        # Agreement at cuts and checkpoint barriers on a CPU group of their own, whatever the device.
        group = tdist.new_group(list(range(self.world)), backend="gloo")
        self.comm = Comm(self.world, group)
        self.control = CutControl(group, self.engine.is_last_stage())
        self.train_data = MicroBatches(setup.data_dir, "train", t.seq_len, t.micro_batch_size, cfg.seed)
        self.tokens_per_step = t.micro_batch_size * t.micro_batches * p.data_parallel * t.seq_len
        self._streaming, self._ran = False, 0
        self.cut = cut_blocks(cfg)  # blocks per stage (per chunk in a V) the engine was built with: `pipeline.cut`

    @property
    def step(self) -> int:
        return self.engine.global_steps

    def describe(self) -> str:
        cfg, p = self.cfg, self.cfg.pipeline
        return (
            f"pipeline: {p.stages} stages x {p.data_parallel} replicas, delay {cfg.delay} "
            f"({self.engine.spec.name}), {describe(cfg)}, model {cfg.model.name}, "
            f"{cut_said(cfg, self.cut)}, "
            f"{cfg.train.steps} steps x {self.tokens_per_step} tokens{', compiled' if self.clock.compiled else ''}"
        )

    def train_step(self, sync: bool, save: bool = False) -> None:
        if not self._streaming:  # from the first step to run (after a resume: its checkpoint's step)
            t = self.cfg.train
            stream = _train_stream(
                self.train_data, t.micro_batches, self.cfg.pipeline.data_parallel, self.replica, t.steps, self.step
            )
            self.engine.set_dataiterator(stream)
            self._streaming, self._ran = True, self.step
        began = time.perf_counter()
        self.engine.train_batch(sync=sync, keep=save)  # a deferred step lands before weights are read
        self.clock.record(time.perf_counter() - began)  # the first batch pays the compile (train.compile)
        self._ran += 1  # batches run (their optimizer steps may still be deferred)

    def agree(self, stop: bool) -> Agreement:
        seen = self.control.exchange(stop, self.engine.last_loss)  # what every rank knew one cut ago
        return Agreement(seen.stop, seen.loss, self._ran - 1)

    def settle(self) -> None:
        self.engine.apply_pending(keep=True)  # a halt: a checkpoint follows

    def records(self, synced: bool) -> list[dict]:
        # At a sync'd cut every rank has applied every step: rank 0 collects them all (before a checkpoint is
        # marked complete, so a resumed run's metrics.jsonl has every step up to it).
        return self.engine.poll_metrics(synced=synced)

    def val_share(self, n: int) -> list[int]:
        return val_share(n, self.cfg.pipeline.data_parallel, self.replica)

    def evaluate(self, batches: list) -> float:
        """Collective: the mean val loss over every replica's share (``batches``: this replica's), on every rank."""
        with eager(self.clock.compiled):  # a no-grad graph would be a second compile for a few batches
            return self.engine.evaluate(iter(batches), len(batches))

    def state_dict(self) -> dict:
        from asyncpipe.engines.pipeline.faults import engine_state

        return engine_state(self.engine)

    def load_state_dict(self, state: dict) -> None:
        from asyncpipe.engines.pipeline.faults import load_engine_state

        load_engine_state(self.engine, state)

    def finish(self) -> tuple[Agreement, dict]:
        """The last cut's agreement, then every stage's summary gathered (collective); writes this rank's trace."""
        seen = self.control.finish()
        tail = Agreement(seen.stop, seen.loss, self._ran)
        if self.cfg.pipeline.trace and self.run_dir is not None:
            # One file per rank: (instruction, micro-batch, start, end) on this host's monotonic clock.
            events = [
                {"stage": self.stage, "replica": self.replica, "op": n, "micro_batch": k, "start": a, "end": e}
                for n, k, a, e in self.engine.trace
            ]
            (Path(self.run_dir) / f"trace-rank{self.rank}.json").write_text(json.dumps(events))
        summary = self.engine.stage_summary()
        summary.update(cut_control_wait_s=self.control.wait_s, cuts=self.control.cuts, **self.clock.summary())
        summary["blocks_per_stage"] = list(self.cut)  # the stage cut it ran, in the run's record (summary.json)
        self.engine.release()
        return tail, {"stages": self.comm.gather(summary)}
