"""`train.compile`: the model (simulator) or each pipeline stage's layers compiled with `torch.compile`.

Modules are compiled in place (`nn.Module.compile`), so parameter names, state dicts and checkpoints are the
same in both modes. Shapes are static (`dynamic=False`): every training micro-batch has the same shape. The
simulator compiles `TrainingForward` (the model and its next-token loss as one graph: the log-softmax over the
vocabulary fuses with the head) and leaves the model itself eager; the pipeline compiles each stage's layers.
Evaluation runs eagerly (`eager`): a no-grad forward would be a second graph to compile for a few batches per
evaluation. MoE's dispatch has data-dependent shapes (tokens per expert) and runs
eagerly inside a compiled block (`compile_modules`).

Compile time is paid in the first step (forward and backward graphs) and counted apart (`CompileClock`): that
step is not a training-speed figure. Inductor keeps compiled graphs on disk (FX graph and AOTAutograd caches,
under ``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_$USER``), so later runs of a sweep with the
same model shapes compile from the cache: see docs/performance.md for cold and warm figures.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch

from asyncpipe.errors import UserError
from asyncpipe.model.gpt import lm_loss

SETTINGS = ("auto", "true", "false")
# auto on CPU: compile from 2000 steps. Measured (docs/performance.md, tiny in the study regime, one core): ~0.047 s
# saved per step, a 40 s cold compile (break-even ~850 steps) or 3 s from the inductor cache; on an AVX2-only EPYC
# 0.055 s, 42 s cold, break-even ~800 steps, end to end 1.03-1.22x at 1100 steps. 2000, not 850, keeps
# the CPU study's 1100-step cells eager like their committed records (compiled numerics drift in the last bits).
# auto on CUDA: eager until `make gpu-check` has measured compiled against eager there.
AUTO_CPU_MIN_STEPS = 2000


def setting_of(value: Any) -> str:
    """The normalised `train.compile` value (YAML's true/false arrive as bools, Hydra's as strings)."""
    text = str(value).strip().lower()
    if text not in SETTINGS:
        raise UserError(f"train.compile={value!r} must be one of auto, true, false")
    return text


def wanted(value: Any, device: torch.device, steps: int) -> bool:
    """Whether this run compiles: true/false as set; auto per device (see AUTO_CPU_MIN_STEPS)."""
    setting = setting_of(value)
    if setting != "auto":
        return setting == "true"
    return device.type == "cpu" and steps >= AUTO_CPU_MIN_STEPS


class TrainingForward(torch.nn.Module):
    """``model(x)`` and its mean next-token loss as one module: what a training micro-batch runs. It owns no
    parameter of its own; checkpoints keep saving the model. Compiling this, not the model, puts the loss into the
    compiled graphs: 448 against 471 ms per step with the loss left outside (tiny in the study regime, one core, both
    interleaved in one process on an AVX2-only EPYC). End-to-end figures, in separate processes: docs/performance.md."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(ids), targets)


def compile_modules(modules: Iterable[Optional[torch.nn.Module]], backend: str = "inductor") -> None:
    """Compile each module in place (state dict unchanged); None entries (other stages' layers) are skipped.
    MoE layers inside run eagerly (their dispatch shapes depend on the routing). ``backend``
    (`train.compile_backend`): inductor generates kernels (what trains faster); aot_eager traces the same forward
    and backward graphs (dynamo, AOTAutograd) and runs them with eager kernels: seconds instead of tens of seconds
    of kernel compiling on a CPU, to check a compiled-mode code path rather than its speed."""
    from asyncpipe.model.moe import moe_layers

    for module in modules:
        if module is None:
            continue
        for moe in moe_layers(module):
            moe.forward = torch.compiler.disable(moe.forward)  # type: ignore[method-assign]
        module.compile(dynamic=False, backend=backend)


@contextlib.contextmanager
def eager(compiled: bool = True) -> Iterator[None]:
    """Compiled modules run their eager code inside the block (evaluation); nothing to do for an eager run (and
    torch's compiler is not even imported)."""
    if not compiled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


class CompileClock:
    """Compile time of a compiled run: the first timed step minus the median of the next few (steady) steps.

    ``record(seconds)`` takes each step's wall time; ``compile_s`` is None until ``settle_after`` steady steps
    were seen (or when the run is eager)."""

    def __init__(self, compiled: bool, settle_after: int = 3) -> None:
        self.compiled, self.settle_after = compiled, settle_after
        self.first: Optional[float] = None
        self.steady: list[float] = []
        self.compile_s: Optional[float] = None

    def record(self, seconds: float) -> Optional[float]:
        """Returns the compile time once, when it becomes known; else None."""
        if not self.compiled or self.compile_s is not None:
            return None
        if self.first is None:
            self.first = seconds
            return None
        self.steady.append(seconds)
        if len(self.steady) < self.settle_after:
            return None
        steady = sorted(self.steady)[len(self.steady) // 2]
        self.compile_s = max(0.0, self.first - steady)
        return self.compile_s

    def summary(self) -> dict:
        return {"compiled": self.compiled, **({"compile_s": self.compile_s} if self.compile_s is not None else {})}
