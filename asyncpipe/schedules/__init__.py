"""Pipeline schedules as declared components: one module per schedule (`onef1b`, `twobw`, `dualpipev`,
`pipedream`, `paci`), each declaring a `ScheduleSpec` with `declare_schedule`, the way an optimizer declares
itself in `asyncpipe.registry`.

A declaration says everything the rest of the package needs and nothing else keeps a list of schedules:
its instruction stream (pure Python, DeepSpeed's vocabulary: `asyncpipe.schedules.instructions`), the weight
versions and in-flight micro-batches per stage (the memory model `plan` and `bench` read), its constraints (P, m, delay,
clipping, engines, compensation methods: `config.validate` runs them), and its staleness pattern: which weight
version each micro-batch's forward and backward read on each stage (the simulator reproduces it; the pipeline
engine pins it; `schedule` draws it). ``pipeline.schedule`` picks one by name, or names a module by import path
(``pipeline.schedule=mypkg.myschedule``) whose `declare_schedule` registers it. ``auto`` keeps the old
configs' meaning: ``delay_profile=pipedream`` is `pipedream`, else `onef1b` at delay 0 and `twobw` above.
Torch-free: `config` and `plan` import this.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from asyncpipe.errors import ConfigError, UserError
from asyncpipe.registry import import_named

Ticks = Iterable[list]  # lists of `schedules.instructions.Instruction`, one per tick
# (micro_batches, stages, stage, batches, start, defer_step) -> the stage's ticks for the whole run
Stream = Callable[[int, int, int, int, int, bool], Ticks]
Check = Callable[[Any], None]  # (the whole config) -> raise ConfigError


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule. Versions are counted in optimizer steps of the stage: W(v) after v updates."""

    name: str
    note: str  # one line: what it is (listings, `describe`)
    # The staleness pattern: (P, m, stage, micro-batch k) -> (forward version, backward version), k numbered over
    # the run (batch b holds k = b*m .. b*m+m-1). The simulator reproduces it exactly.
    versions: Callable[[int, int, int, int], tuple[int, int]]
    weight_versions: Callable[[int, int], int]  # (P, stage) -> weight copies the stage holds at most
    in_flight: Callable[[int, int, int], list[int]]  # (P, m, stage) -> peak micro-batches held, per model chunk
    stream: Optional[Stream] = None  # the engine's instruction stream; None: its engine class's own (DeepSpeed's)
    ideal: Optional[Stream] = (
        None  # the stream its ideal timeline replays, when not ``stream`` (DeepSpeed's, translated)
    )
    # or its one-batch op order, (P, m) -> `asyncpipe.schedules.orders.Plan` (replayed by data dependencies)
    order: Optional[Callable[[int, int], Any]] = None
    # the engine's own stream written out, when neither ``stream`` nor ``ideal`` is it (the cost model replays it;
    # the ideal timeline, drawings and bubbles keep ``order``): DualPipeV's DeepSpeed ticks, with their commits
    cost_stream: Optional[Stream] = None
    bubble_note: str = ""  # a few words on its bubble, for the bubble table
    label: str = ""  # how tables and figures name it ("1F1B"); "" = its name
    # (P) -> the fewest micro-batches per batch its order runs with, checked centrally (`fits`) wherever the order
    # runs: the pipeline engine, the simulator running the stages apart, the drawing, the cost model, bench
    min_micro_batches: Optional[Callable[[int], int]] = None
    delay: Optional[int] = None  # the uniform delay it implies (checked against `delay`); None: any the check allows
    chunks: int = 1  # model chunks per rank (2: a V, DualPipeV)
    engines: tuple[str, ...] = ("simulate", "pipeline")
    clip_modes: tuple[str, ...] = ("global", "stage")  # pipeline.clip values it can honour (with grad_clip > 0)
    compensations: Optional[tuple[str, ...]] = None  # methods it composes with; None: every one that fits 2BW
    check: Optional[Check] = None  # its own constraints (P, m, eval batches, ...): one-line ConfigErrors
    engine_class: Optional[str] = None  # "module:Class" of its pipeline engine (default ScheduledPipelineEngine)
    module_class: Optional[str] = None  # "module:Class" of its staged module (default StagedModule)
    # A micro-batch whose stage was updated since its forward (a straddler): its backward either recomputes the
    # forward on the current weights (``recompute``) or goes through the forward's own graph, whose saved weight
    # tensors the in-place step has moved to the current version (``inplace``: torch's saved-tensor version check
    # is lifted for that forward). Neither: forward and backward always read one version.
    recompute: bool = False
    inplace: bool = False
    revision: int = 1  # bumped when what it computes changes (asyncpipe.report.revisions keeps what each one was)
    # Its stream receives each kind (activation, gradient) in micro-batch order, so the engine may post the next
    # receive ahead of its instruction (`asyncpipe.engines.pipeline.p2p`); a stream that does not must leave it False.
    in_order: bool = False
    flush: bool = True  # the stream ends every batch with all its micro-batches done (a synchronous schedule)
    # The simulator's staleness when each stage reads one version per batch (fwd = bwd): (P, stage, delay) ->
    # steps stale; None: per micro-batch (the simulator runs the stages apart, see `versions`).
    stage_delay: Optional[Callable[[int, int, int], int]] = None
    module: str = ""

    @property
    def orders(self) -> Optional[str]:
        """The name of the one-batch order it is replayed by when it has no stream (`schedules.orders.plans`)."""
        return self.name if self.order is not None and self.stream is None and self.ideal is None else None

    @property
    def straddle(self) -> str:
        """How a straddler's backward runs: "recompute", "inplace", or "" (no straddlers)."""
        return "recompute" if self.recompute else "inplace" if self.inplace else ""

    def fits(self, P: int, m: int) -> bool:
        """Whether its order runs P stages with m micro-batches per batch (its declared ``min_micro_batches``)."""
        return self.min_micro_batches is None or m >= self.min_micro_batches(P)

    def straddles(self, P: int, m: int, stage: int, k: int) -> bool:
        """Whether micro-batch ``k``'s forward and backward read different versions on ``stage``."""
        f, b = self.versions(P, m, stage, k)
        return f != b


_SCHEDULES: dict[str, ScheduleSpec] = {}
_loaded = False


def declare_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Register ``spec`` (call it at a module's top level); its ``module`` is filled from the caller's name."""
    import inspect

    caller = inspect.stack()[1].frame.f_globals.get("__name__", "")
    spec = ScheduleSpec(**{**spec.__dict__, "module": spec.module or caller})
    old = _SCHEDULES.get(spec.name)
    if old is not None and old.module != spec.module:
        raise UserError(
            f"schedule {spec.name!r} is already declared by {old.module}; {spec.module} must declare its schedule "
            "under another name"
        )
    _SCHEDULES[spec.name] = spec
    return spec


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def schedules() -> list[ScheduleSpec]:
    """Every schedule: the built-ins by module name (whatever imported one first), then any registered since."""
    _load_builtins()
    order = {info.name: i for i, info in enumerate(pkgutil.iter_modules(__path__))}
    return sorted(_SCHEDULES.values(), key=lambda s: order.get(s.module.rsplit(".", 1)[-1], len(order)))


def names() -> list[str]:
    """The built-in and registered schedules' names: the one list (validation, `schedule`, bench read it)."""
    return [s.name for s in schedules()]


def get(name: str) -> ScheduleSpec:
    """The schedule ``name``, or the one an import path (``pkg.module``) declares; unknown: one line."""
    _load_builtins()
    if name in _SCHEDULES:
        return _SCHEDULES[name]
    if "." in name:
        import_named(name, f"pipeline.schedule={name}")
        found = [s for s in _SCHEDULES.values() if s.module == name]
        if len(found) != 1:
            raise UserError(
                f"pipeline.schedule={name} declares {len(found)} schedules with "
                "asyncpipe.schedules.declare_schedule; it must declare exactly one"
            )
        return found[0]
    raise ConfigError(
        f"pipeline.schedule={name} is unknown; choose one of: auto, {', '.join(sorted(_SCHEDULES))} "
        "(or name your own module: pipeline.schedule=pkg.module)"
    )


def resolve(cfg: Any) -> ScheduleSpec:
    """The schedule a composed config runs (``auto``: see the module docstring)."""
    name = str(cfg.pipeline.schedule)
    if name == "auto":
        if cfg.get("delay_profile", "uniform") == "pipedream":
            name = "pipedream"
        else:
            name = "1f1b" if int(cfg.delay) == 0 else "2bw"
    return get(name)


def implied(cfg: Any) -> dict[str, Any]:
    """The settings a named schedule declares that ``cfg`` contradicts, as {dotted key: the declared value}: its
    delay, and the first clipping mode it allows when ``pipeline.clip`` is one it cannot honour (with clipping on).
    Composition sets them unless the user typed the key (`asyncpipe.config.alias.apply_schedule_defaults`), so
    only an explicit contradiction reaches `check`'s one-line refusal. ``auto`` implies nothing."""
    if str(cfg.pipeline.schedule) == "auto":
        return {}
    s = resolve(cfg)
    out: dict[str, Any] = {}
    if s.delay is not None and int(cfg.delay) != s.delay:
        out["delay"] = s.delay
    if cfg.train.grad_clip > 0 and cfg.pipeline.clip not in s.clip_modes:
        out["pipeline.clip"] = s.clip_modes[0]
    return out


def revisions(cfg: Any) -> dict[str, dict[str, Any]]:
    """What a run records of its code's rules (provenance.json "revisions"): the optimizer's, the effective
    compensation method's and the pipeline schedule's name and declared revision."""
    from asyncpipe.registry import of_config

    opt, method = of_config(cfg)
    schedule = resolve(cfg)
    return {
        "optimizer": {"name": opt.name, "revision": opt.revision},
        "compensation": {"name": method.name, "revision": method.revision},
        "schedule": {"name": schedule.name, "revision": schedule.revision},
    }


def check(cfg: Any) -> None:
    """What every schedule's declaration implies for a config, then its own check (`config.validate` calls it)."""
    s = resolve(cfg)
    named = f"pipeline.schedule={s.name}"
    if cfg.get("delay_profile", "uniform") == "pipedream" and s.name != "pipedream":
        raise ConfigError(
            f"delay_profile=pipedream is the pipedream schedule (simulator only); {named} has its own "
            "staleness: drop one of them"
        )
    if cfg.engine not in s.engines:
        raise ConfigError(f"{named} runs in engine={' or engine='.join(s.engines)}, not engine={cfg.engine}")
    if s.delay is not None and int(cfg.delay) != s.delay:
        raise ConfigError(f"{named} is {s.note}: its delay is {s.delay}; use delay={s.delay}, got delay={cfg.delay}")
    t, p = cfg.train, cfg.pipeline
    if t.grad_clip > 0 and p.clip not in s.clip_modes:
        raise ConfigError(
            f"{named} cannot clip with pipeline.clip={p.clip}: {s.note}; use pipeline.clip="
            f"{' or pipeline.clip='.join(s.clip_modes)}, or train.grad_clip=0"
        )
    if s.compensations is not None:
        comp = cfg.compensation.name
        if comp not in s.compensations:
            raise ConfigError(
                f"compensation={comp} is not defined under {named}; use compensation="
                f"{' or compensation='.join(s.compensations)}"
            )
    P, m = int(p.stages), int(t.micro_batches)
    if s.min_micro_batches is not None and not s.fits(P, m) and (cfg.engine == "pipeline" or s.stage_delay is None):
        least = s.min_micro_batches(P)  # where its order runs: the engine's stream, or the simulator's stages apart
        need = "pipeline.stages" if least == P else least
        raise ConfigError(f"{s.label or named} needs train.micro_batches >= {need}, got {m} < {least}")
    if s.check is not None:
        s.check(cfg)
    check_staleness(s, cfg)


def check_staleness(s: ScheduleSpec, cfg: Any) -> None:
    """A schedule's staleness is declared once, by ``versions``: what else it declares about staleness must agree
    with it at the run's P and m, or the config is refused in one line (the simulator and the engine would
    otherwise disagree, or fail mid-run). ``stage_delay`` (one version per stage and batch) must be what
    ``versions`` says; without it the simulator (engine=simulate) runs the stages apart (`asyncpipe.engines.staged`),
    which needs a straddle recipe, every backward on the batch's own version and a forward at most one step older;
    the engine's stream (engine=pipeline) must pin the versions ``versions`` gives. ``versions`` describe the
    pipeline run (delay 0 or 1): a uniform schedule's k-step generalisation in the simulator is checked at delay 1."""
    P, m = int(cfg.pipeline.stages), int(cfg.train.micro_batches)
    delay = s.delay if s.delay is not None else min(int(cfg.delay), 1)
    named = f"pipeline.schedule={s.name}"
    apart = s.stage_delay is None and cfg.engine == "simulate"
    if apart and not s.straddle:
        raise ConfigError(
            f"{named} declares no stage_delay, so the simulator runs its stages apart, which needs a straddle "
            "recipe (recompute or inplace); declare stage_delay or one of them"
        )
    for stage in range(P):
        for k in range((P + 3) * m):
            b, (fwd, bwd) = k // m, s.versions(P, m, stage, k)
            where = f"micro-batch {k} (batch {b}) on stage {stage} reads W({fwd}) forward, W({bwd}) backward"
            if s.stage_delay is not None:
                v = max(b - s.stage_delay(P, stage, delay), 0)
                if (fwd, bwd) != (v, v):
                    raise ConfigError(
                        f"{named} declares stage_delay {b - v} on stage {stage} but its versions disagree: "
                        f"{where}, not W({v}); declare its staleness once"
                    )
            elif apart and (bwd != b or fwd not in (b, max(b - 1, 0))):
                raise ConfigError(
                    f"{named}: {where}; the simulator runs its stages apart (no stage_delay), which needs every "
                    "backward on the batch's version W(b), every forward on W(b) or W(b-1)"
                )
    if s.stream is not None and cfg.engine == "pipeline":
        check_stream_versions(s, P, m)


def check_stream_versions(s: ScheduleSpec, P: int, m: int, batches: int = 3) -> None:
    """The versions the engine's stream pins on each forward and backward are those ``versions`` declares."""
    assert s.stream is not None
    for stage in range(P):
        for tick in s.stream(m, P, stage, batches, 0, False):
            for cmd in tick:
                kind = type(cmd).__name__
                if kind not in ("ForwardPass", "BackwardPass"):
                    continue
                declared = s.versions(P, m, stage, cmd.micro_batch)[kind == "BackwardPass"]
                if cmd.version != declared:
                    raise ConfigError(
                        f"pipeline.schedule={s.name}: its stream runs the {kind} of micro-batch {cmd.micro_batch} "
                        f"on stage {stage} on W({cmd.version}), its versions say W({declared}); declare its "
                        "staleness once (versions)"
                    )


def staged(spec: ScheduleSpec, P: int, delay: int) -> bool:
    """Whether the schedule's staleness differs between stages (the simulator then needs the stage cut)."""
    if spec.stage_delay is None:
        return True
    return len({spec.stage_delay(P, s, delay) for s in range(P)}) > 1


# -- helpers the declarations share -------------------------------------------------------------------------
def one_f_one_b_in_flight(P: int, m: int, stage: int) -> list[int]:
    """1F1B's rhythm: P-1-s warm-up forwards then one forward per backward, so min(P-s, m) micro-batches (the
    2BW and PACI streams keep the rhythm across batches: P-s)."""
    return [min(P - stage, m)]


def uniform(delay: int) -> Callable[[int, int, int, int], tuple[int, int]]:
    """Batch b reads W(max(b - delay, 0)) on every stage, forward and backward."""

    def versions(P: int, m: int, stage: int, k: int) -> tuple[int, int]:
        v = max(k // m - delay, 0)
        return v, v

    return versions
