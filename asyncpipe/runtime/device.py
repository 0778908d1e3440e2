"""Device, precision and vocabulary decisions shared by the simulator and the pipeline stages.

The run's one device choice is `pick_device`: which CUDA device this rank uses, whatever started it (one process,
the local launcher, torchrun, a SLURM task). The rule, for a rank with local rank L among the N ranks on its node,
in a process that sees V GPUs (`CUDA_VISIBLE_DEVICES`, as SLURM, the user or a sweep set it; never rewritten here):

- N <= V: the rank uses visible GPU L (cuda:L). Every launcher here gives each rank of a node the node's GPUs
  (torchrun, the local launcher, SLURM's default binding), so local ranks index them.
- V = 1 under a SLURM task binding (`--gpus-per-task=1` or `--gpu-bind`: SLURM lists more GPUs for the step than
  this task sees): the task's own GPU, cuda:0.
- otherwise more ranks than GPUs on the node: one `UserError` (ranks never share a GPU silently).

The chosen index is also written to LOCAL_RANK, which is where DeepSpeed's PipelineModule and engine put a stage
(`cuda:LOCAL_RANK`), so the stage, `torch.cuda.current_device()` and the run agree.

This module imports torch only inside functions: the sweep layer reads `visible_gpus` without it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import TYPE_CHECKING, Any, ContextManager, Mapping, Optional

from asyncpipe.errors import UserError

if TYPE_CHECKING:
    import torch


def _entries(text: Optional[str]) -> Optional[list[str]]:
    """The entries of a GPU list such as CUDA_VISIBLE_DEVICES ("4,5", "GPU-uuid,...", "" = none); None if unset."""
    if text is None:
        return None
    return [e.strip() for e in text.split(",") if e.strip() and e.strip() != "-1"]


def visible_gpus(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The GPUs a process started with ``env`` would see, as CUDA_VISIBLE_DEVICES entries (ids or UUIDs): the
    variable's entries when set, else every GPU `nvidia-smi -L` lists (none without nvidia-smi). Torch-free: the
    sweep's local launcher splits these between the runs it starts at once."""
    env = os.environ if env is None else env
    listed = _entries(env.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        return listed
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _slurm_bound(env: Mapping[str, str], visible: int) -> bool:
    """True when SLURM bound this task to its own GPU(s): the step (or job) holds more GPUs on this node than the
    task sees."""
    if "SLURM_LOCALID" not in env:
        return False
    step = _entries(env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"))
    return step is not None and len(step) > visible


def cuda_index(local_rank: int, local_world: int, visible: int, env: Optional[Mapping[str, str]] = None) -> int:
    """The visible CUDA device of the rank with ``local_rank`` among ``local_world`` ranks on its node, in a process
    that sees ``visible`` GPUs (the rule in this module's docstring); a `UserError` when there are too few."""
    env = os.environ if env is None else env
    shown = env.get("CUDA_VISIBLE_DEVICES")
    sees = f"sees {visible} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    if visible < 1:
        raise UserError(f"device=cuda but this process {sees}; use device=auto or device=cpu")
    if local_world <= visible and local_rank < visible:
        return local_rank
    if visible == 1 and _slurm_bound(env, visible):
        return 0
    raise UserError(
        f"{local_world} ranks run on this node but rank {local_rank}'s process {sees}: each rank needs its own GPU; "
        "ask for as many GPUs per node as ranks per node (launcher.gpus_per_node), fewer stages x replicas, "
        "or device=cpu"
    )


def local_world_size(world: int, env: Optional[Mapping[str, str]] = None) -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE (torchrun, submitit's export, the local launcher set it), else the
    whole world (one node)."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_WORLD_SIZE") or world)


def pick_device(name: str) -> "torch.device":
    """The run's one device choice, for this process's rank (`asyncpipe.dist.rank_env`; none: local rank 0 of 1).

    `auto` = CUDA when present, else CPU; `cuda` without a GPU is a user error. On CUDA the device is indexed
    (`cuda_index`), made current (`torch.cuda.set_device`), and its index written to LOCAL_RANK for DeepSpeed."""
    import torch

    from asyncpipe.dist import rank_env

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    if not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    _, world, local = rank_env() or (0, 1, 0)
    index = cuda_index(local, local_world_size(world), torch.cuda.device_count())
    torch.cuda.set_device(index)
    os.environ["LOCAL_RANK"] = str(index)  # DeepSpeed places the stage on cuda:LOCAL_RANK
    return torch.device("cuda", index)


def set_deterministic(on: bool) -> None:
    """``train.deterministic``: every op takes its deterministic kernel, or raises where it has none (torch's
    `use_deterministic_algorithms`: MoE's `index_add_` and the embedding's backward stop using atomics, cuDNN
    and cuBLAS (CUBLAS_WORKSPACE_CONFIG, set here before any CUDA matmul) their reproducible algorithms). Call
    before the device is first used. Off, runs are bit-reproducible on the CPU only (see docs/cluster.md)."""
    import torch

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on)  # set both ways: a process may build several runs (tests, benchmarks)
    torch.backends.cudnn.deterministic = on


def use_bf16(device: "torch.device", precision: str) -> bool:
    """bf16 autocast when asked for, or with precision=auto on CUDA."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast_context(device: "torch.device", precision: str) -> ContextManager:
    """bf16 autocast over fp32 master weights (auto: on CUDA only); fp32 otherwise."""
    import torch

    if not use_bf16(device, precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def vocab_size_for(model_cfg: Any, manifest: dict) -> int:
    """The model's vocabulary: its own size when set (presets), else the tokenizer's; never smaller than it."""
    tok_vocab = int(manifest["tokenizer"]["vocab_size"])
    if model_cfg.vocab_size is None:
        return tok_vocab
    if model_cfg.vocab_size < tok_vocab:
        raise UserError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {tok_vocab} ids; "
            "raise it or set model.vocab_size=null"
        )
    return int(model_cfg.vocab_size)
