"""`ScheduledPipelineEngine`: DeepSpeed's `PipelineEngine` running the schedule its settings name, as declared in
`asyncpipe.schedules` (DeepSpeed's 1F1B, 2BW, PACI; DualPipeV through the `engines.pipeline.dualpipev` subclass), by
extending the instruction map as DeepSpeed's own `DualPipeVEngine` does.

A schedule that declares a stream (2BW, PACI) runs as one instruction stream for the whole run (no flush), each
micro-batch on the weight version its declaration pins, from a `WeightStash`; one that declares none runs its engine
class's own (DeepSpeed's `TrainSchedule`). A straddling micro-batch (stage stepped since its forward) recomputes its
forward on the current weights (paci-recompute) or back-propagates through its own graph (paci). Every schedule ends
a batch with the same `ReduceGrads` / `OptimizerStep` handlers (`asyncpipe.engines.pipeline.batch_end`, which calls
`asyncpipe.optim`: clipping, lr schedule, update), so the math is the simulator's; gradient norms cross stages by an
all-reduce that, deferred, overlaps the next batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, ContextManager, Iterator, Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from asyncpipe.engines.pipeline import memory
from asyncpipe.schedules import instructions as sched
from asyncpipe.engines.pipeline.actmem import ActivationMeter
from asyncpipe.engines.pipeline.batch_end import BatchEnd
from asyncpipe.engines.pipeline.clock import StageClock
from asyncpipe.engines.pipeline.metrics import StepReporter
from asyncpipe.engines.pipeline.p2p import BatchedP2P
from asyncpipe.engines.pipeline.stage import PipeSettings
from asyncpipe.engines.pipeline.stage_metrics import StageMetrics
from asyncpipe.engines.pipeline.standin import StandInPad
from asyncpipe.engines.pipeline.stash import WeightStash
from asyncpipe.engines.pipeline.tied import TiedGrads
from asyncpipe.runtime.previous import PreviousWeights
from asyncpipe.runtime.saved import keep_saved_tensors
from asyncpipe.schedules import get as get_schedule


_WAIT = (
    ds_schedule.SendActivation,
    ds_schedule.RecvActivation,
    ds_schedule.SendGrad,
    ds_schedule.RecvGrad,
    sched.CommitP2P,
    ds_schedule.CommitP2P,
)
_FORWARD, _BACKWARD = (sched.ForwardPass, ds_schedule.ForwardPass), (sched.BackwardPass, ds_schedule.BackwardPass)


class ScheduledPipelineEngine(BatchedP2P, StageMetrics, BatchEnd, PipelineEngine):
    """A `PipelineEngine` whose training schedule is 2BW (delay=1), DeepSpeed's 1F1B (delay=0) or a subclass's.

    Call `train_batch()` once per optimizer step (the data iterator yields (x, y) micro-batches in order).
    Rank 0 reads whole-pipeline step metrics with `poll_metrics()` (each step's arrive when every rank has
    applied it); `evaluate()` is a collective forward-only pass on the latest weights.
    """

    def __init__(self, *args: Any, settings: PipeSettings, **kwargs: Any) -> None:
        self.settings = settings
        super().__init__(*args, **kwargs)
        if self.is_pipe_partitioned or self.is_grad_partitioned or self.module.tied_comms:
            raise ValueError("ScheduledPipelineEngine needs a plain pipeline: no tensor parallelism, no tied layers")
        if self.zero_optimization() or self.fp16_enabled() or self.bfloat16_enabled():
            raise ValueError("use a client fp32 optimizer (bf16 via torch_autocast), not DeepSpeed's ZeRO/fp16/bf16")
        self.spec = get_schedule(settings.schedule)
        P, s = self.num_stages, self.stage_id
        self.stash = WeightStash(self.module, self.spec.weight_versions(P, s) - 1)  # the stash holds 1 or 2
        # a tied embedding's two copies (`engines.pipeline.tied`)
        self.tied = TiedGrads.of_deepspeed(self, settings.tied)
        self.activations = ActivationMeter(self._weight_tensors)
        self.pipe_buffers["grads"], self.pipe_buffers["losses"] = [], []
        self.init_p2p()
        self.world, self.rank = tdist.get_world_size(), tdist.get_rank()
        self._pipe_group = self.grid.get_pipe_parallel_group()
        self._dp_group = self.grid.get_data_parallel_group()
        self._dp = self.grid.get_data_parallel_world_size()
        # A gloo group of its own keeps metric messages (CPU vectors) out of the activation/gradient message order.
        self.reporter = StepReporter(self.rank, self.world, tdist.new_group(list(range(self.world)), backend="gloo"))
        cross_stage = settings.clip == "global" and settings.max_norm > 0 and self.num_stages > 1
        self._global_norm = cross_stage
        counts: list = [None] * self.num_stages
        tdist.all_gather_object(counts, self.tied.norm_tensors(len(self.stash.params)), group=self._pipe_group)
        self._tensor_offset, self._n_tensors_total = sum(counts[: self.stage_id]), sum(counts)
        defer = settings.defer_step if settings.defer_step is not None else cross_stage
        # A deferred step needs the next batch to run on another version meanwhile (2BW's second one).
        self.defer_step = bool(defer and self.spec.stream is not None and self.stash.delay == 1)
        self._cmds: Optional[Iterator[sched.Instruction]] = None
        self._fwd_version: dict[int, tuple] = {}  # buffer -> (version its forward read, the stash's version used)
        self.straddled = 0  # backwards on a newer version than their forward's (PACI's straddlers)
        # W(v-1) for a checkpoint of a stage with straddlers (PACI, s < P-1), and whether a resumed stream's warm-up
        # (forwards on it) is still to run.
        self.previous = PreviousWeights(self.stash.params, bool(self.spec.straddle) and s < P - 1)
        self._resuming = False
        # A step that nothing reads before the next batch may stay pending past the cut: 2BW's deferred step,
        # and PACI's (next in its stream), so that a checkpoint can copy the weights before it (`apply_pending`).
        self._holds_step = self.defer_step or bool(self.spec.straddle)
        self.standin = StandInPad(self.settings.standin, self.spec.chunks)  # stand-in compute (pipeline.standin)
        self._open_stream(0)
        self.fwd_outputs: list = []
        self._batches_run = 0
        self._batch_loss: dict[int, list] = {}
        self._pending: dict[int, tuple] = {}
        # Seconds waiting / computing: host clocks on the CPU (and under trace, which synchronises), CUDA events
        # on a GPU, where NCCL waits stall the stream, not the host (`asyncpipe.engines.pipeline.clock`).
        self.timer = StageClock(self.device, host=settings.trace)
        self._mark = dict(self.timer.totals)
        self._batch_walls: dict[int, float] = {}  # batch -> seconds its train_batch() call took here
        # batch -> seconds from the previous cut to its own (its call plus the trainer's work at the cut before: on
        # the critical path of a stream with no flush); the step time every record reports
        self._batch_periods: dict[int, float] = {}
        self._last_cut: Optional[float] = None  # reset by evaluate(), which is no step's time
        self.batch_wall_s = 0.0  # seconds in train_batch() calls so far
        self.batch_ops: list[dict] = []  # stand-in: per train_batch() call, its wall and per-instruction figures
        self.eval_seconds_by_op: dict[str, float] = {}  # instruction seconds spent in evaluate() (in by_op too)
        self.trace: list[tuple] = []
        self.last_loss = math.nan  # last stage: mean train loss of the latest reduced batch
        self.memory_baseline = memory.mark(self.device)  # reset to before the stage's layers were built

    # -- the schedule ----------------------------------------------------------------------------------
    def train_batch(self, data_iter: Any = None, sync: bool = True, keep: bool = False) -> None:  # type: ignore[override]
        """Run this stage through the next batch: up to its `ReduceGrads`, the same cut on every stage, where
        no message between stages is in flight (2BW: no flush, the next batch is already under way).

        The batch's optimizer step is applied before returning unless the step is deferred and ``sync`` is
        False: then it runs later in the stream, overlapping its cross-stage all-reduce. Call with ``sync``
        before anything that reads the weights (evaluation) and for the last batch; with ``keep`` as well before a
        checkpoint (`apply_pending`)."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        b = self._batches_run
        if b >= self.settings.total_steps:
            raise RuntimeError(f"all {self.settings.total_steps} steps of this engine's run are done")
        self._batches_run += 1
        if not self._resuming:
            self.previous.drop()  # the copy a checkpoint at the last cut needed
        started = time.perf_counter()
        before = self._ops_mark()
        self.module.train()
        self._compute_loss = True
        self.total_loss = None
        self.fwd_outputs = []
        if self._cmds is None:
            self._exec_schedule(self._train_schedule())  # DeepSpeed's TrainSchedule (or a subclass's, e.g. DualPipeV)
        else:
            self._reserve_pipe_buffers(self._stream_buffers())
            while True:
                cmd = next(self._cmds)
                if isinstance(cmd, sched.OptimizerStep) and cmd.batch < self.global_steps:
                    continue  # applied early by a sync
                self._run(cmd)
                if isinstance(cmd, sched.ReduceGrads) and cmd.batch == b:
                    break
            if self.p2p_ops:
                raise RuntimeError("a batch ended with communication queued but not committed")
            if sync or not self._holds_step:
                self.apply_pending(keep)
            self._resuming = False
            if b == self.settings.total_steps - 1:
                rest = list(self._cmds)
                if any(not isinstance(c, sched.OptimizerStep) or c.batch >= self.global_steps for c in rest):
                    raise RuntimeError(f"stage {self.stage_id}: instructions left after the last batch: {rest}")
        ended = time.perf_counter()
        self._batch_walls[b] = ended - started
        self._batch_periods[b], self._last_cut = ended - (self._last_cut or started), ended
        self.batch_wall_s += self._batch_walls[b]
        self._ops_record(before, self._batch_walls[b])

    @property
    def batches_run(self) -> int:
        """Batches whose `train_batch` call returned (their optimizer steps may still be deferred)."""
        return self._batches_run

    def apply_pending(self, keep: bool = False) -> None:
        """At a cut: apply the deferred optimizer steps of the batches run so far (in order), as ``sync`` does.
        ``keep``: a checkpoint follows; a stage with straddlers copies its weights before the last step first."""
        while self.global_steps < self._batches_run:
            if keep and self.global_steps == self._batches_run - 1:
                self.previous.keep()
            self._run(sched.OptimizerStep(batch=self.global_steps))

    def restart_at(self, step: int) -> None:
        """Continue after ``step`` optimizer steps (a resumed checkpoint): `train_batch` runs batch ``step`` next."""
        self.global_steps = self._batches_run = step
        self.global_samples = step * self.train_batch_size()
        self._resuming = True  # its first forwards may read W(step-1): `previous`, loaded with the checkpoint
        self._open_stream(step)

    def _open_stream(self, start: int) -> None:
        """The declared stream from batch ``start`` to the run's end (no flush); `train_batch` runs it cut by cut."""
        if self.spec.stream is None:
            return
        ticks = self.spec.stream(
            self.micro_batches, self.num_stages, self.stage_id, self.settings.total_steps, start, self.defer_step
        )
        self._cmds = (cmd for tick in ticks for cmd in tick)

    def _stream_buffers(self) -> int:
        """The declared peak in flight here plus a spare slot (a receive never lands on a slot still being sent)."""
        return sum(self.spec.in_flight(self.num_stages, self.micro_batches, self.stage_id)) + 1

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                self._run(cmd)

    def _run(self, cmd: Any) -> None:
        fn = self._INSTRUCTION_MAP.get(type(cmd))
        if fn is None:
            raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
        if self.settings.trace and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with self.timer.instruction(type(cmd).__name__, isinstance(cmd, _WAIT)):
            if isinstance(cmd, _FORWARD):
                with self.activations.forward((cmd.kwargs.get("phase"), cmd.kwargs["buffer_id"])):
                    fn(self, **cmd.kwargs)
                self.standin.pad(0, "forward", start, cmd.kwargs.get("phase"))
            else:
                fn(self, **cmd.kwargs)
                if isinstance(cmd, _BACKWARD):
                    self.activations.backward_done((cmd.kwargs.get("phase"), cmd.kwargs["buffer_id"]))
                    self.standin.pad(1, "backward", start, cmd.kwargs.get("phase"))
        if self.settings.trace and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        if self.settings.trace:
            self.trace.append((type(cmd).__name__, cmd.kwargs.get("micro_batch"), start, end))

    def _weight_tensors(self) -> list[torch.Tensor]:
        """Every weight and buffer tensor a forward may read (both stashed versions): not activations."""
        slots = [t for slot in self.stash.slots if slot is not None for t in slot]
        return [*self.module.parameters(), *self.module.buffers(), *self.stash.params, *slots]

    def _waiting(self, what: str) -> ContextManager[None]:
        return self.timer.waiting(what)

    # -- 2BW compute: DeepSpeed's forward/backward on the micro-batch's pinned weight version ------------
    def _tb_load(self, buffer_id: int, micro_batch: int) -> None:
        PipelineEngine._exec_load_micro_batch(self, buffer_id)

    def _tb_forward(self, buffer_id: int, micro_batch: int, version: int) -> None:
        inplace = self.spec.inplace and self.spec.straddles(
            self.num_stages, self.micro_batches, self.stage_id, micro_batch
        )
        older = self.previous.needed and version < self.stash.latest  # a resumed PACI warm-up: W(latest-1)
        used = self.stash.latest if older else version
        with (
            self.previous.applied() if older else contextlib.nullcontext(),
            self.stash.use(used),
            keep_saved_tensors() if inplace else contextlib.nullcontext(),
        ):
            PipelineEngine._exec_forward_pass(self, buffer_id)
        self._fwd_version[buffer_id] = (version, used)
        if self.is_last_stage():
            self.pipe_buffers["losses"][buffer_id] = self.loss
            acc = self._batch_loss.setdefault(micro_batch // self.micro_batches, [0.0, 0])
            acc[0] = acc[0] + self.loss.detach().float()
            acc[1] += 1

    def _tb_backward(self, buffer_id: int, micro_batch: int, version: int) -> None:
        if self.is_last_stage():
            self.loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
        else:
            self.grad_layer = self.pipe_buffers["grads"][buffer_id]
            self.pipe_buffers["grads"][buffer_id] = None
        read, used = self._fwd_version.pop(buffer_id)
        if read != version:
            self._straddle(buffer_id, read, version)
        PipelineEngine._exec_backward_pass(self, buffer_id)
        self.stash.release(used)
        # What DeepSpeed leaves to cyclic buffer reuse: the loss stage's logits and labels, stage 0's inputs.
        self.pipe_buffers["outputs"][buffer_id] = None
        self.grad_layer = None
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = None
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = None

    def _straddle(self, buffer_id: int, read: int, version: int) -> None:
        """The forward of the micro-batch in ``buffer_id`` read W(read), this stage now holds W(version).
        ``inplace``: its graph saved the parameters themselves (`keep_saved_tensors`), which the in-place step
        moved to W(version): back-propagate through it as it is. ``recompute``: run the forward again from the
        saved stage input on the current weights and back-propagate through that graph; the old graph is dropped
        unused, so autograd's version check never fires (the stage's gradient at W(version) for its input)."""
        if not self.spec.straddle or version != self.stash.latest or self.is_last_stage():
            raise RuntimeError(
                f"stage {self.stage_id}: backward on W{version} of a forward on W{read} "
                f"(schedule {self.spec.name} declares no straddlers)"
            )
        self.straddled += 1
        if self.spec.inplace:
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        inputs = self.pipe_buffers["inputs"][buffer_id]
        x = tuple(t.clone() for t in inputs) if isinstance(inputs, tuple) else inputs.clone()
        self.pipe_buffers["outputs"][buffer_id] = None  # the stale graph goes first
        self.pipe_buffers["outputs"][buffer_id] = DeepSpeedEngine.forward(self, x)
        self.standin.recomputed_forward()

    def release(self) -> None:
        """Drop the last micro-batches' tensors at the run's end: their graphs hold DeepSpeed's backward hooks, closures
        over this engine that gc cannot follow through C++ nodes, which kept each finished engine alive in its rank."""
        self.loss = self.total_loss = None
        self.fwd_outputs, self.pipe_buffers = [], {k: [] for k in self.pipe_buffers}

    # -- evaluation: a collective forward-only pass on the latest weights ---------------------------------
    def evaluate(self, data_iter: Any, num_micro_batches: int) -> float:
        """Mean loss over ``num_micro_batches`` from ``data_iter`` (averaged over replicas), on every rank.

        Training buffers of in-flight 2BW micro-batches are set aside and restored around DeepSpeed's
        `eval_batch`, so evaluating never disturbs the running pipeline."""
        saved = (self.pipe_buffers, self.num_pipe_buffers, self.loss, self.total_loss, self.fwd_outputs)
        self._last_cut = None
        self.pipe_buffers = {k: [] for k in saved[0]}
        self.num_pipe_buffers = 0
        self.timer.settle()
        before = dict(self.timer.by_op)
        try:
            loss = self.eval_batch(data_iter, num_micro_batches=num_micro_batches)
        finally:
            self.pipe_buffers, self.num_pipe_buffers, self.loss, self.total_loss, self.fwd_outputs = saved
            self.module.train()
            self.timer.settle()
            for k, v in self.timer.by_op.items():  # instruction time outside train_batch (stand-in breakdowns)
                self.eval_seconds_by_op[k] = self.eval_seconds_by_op.get(k, 0.0) + v - before.get(k, 0.0)
        return float(loss)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        **BatchEnd.INSTRUCTIONS,  # DeepSpeed's ReduceGrads / OptimizerStep and the stream's
        ds_schedule.ReduceTiedGrads: lambda self: None,  # untied models only (checked in __init__)
        sched.LoadMicroBatch: _tb_load,
        sched.ForwardPass: _tb_forward,
        sched.BackwardPass: _tb_backward,
        **BatchedP2P.INSTRUCTIONS,
    }
