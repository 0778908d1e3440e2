"""A run's set-up in this process, built in one call (`build_setup`): its place in the run (the rank environment),
determinism, the device (`runtime.device.pick_device`), the process group (`dist.init_process_group`, plus
DeepSpeed's comm for engine=pipeline) and the prepared data (rank 0 prepares, the others wait). The trainer
calls it once; the engines receive the `Setup` it returns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from asyncpipe.dist import Comm, rank_env
from asyncpipe.errors import UserError
from asyncpipe.runtime.protocol import Log, Setup


def build_setup(cfg: DictConfig, log: Log) -> Setup:
    """This process's `Setup` for the run ``cfg``, built in this order: rank environment, determinism (before the
    device's first use: cuBLAS reads its env then), device, process group (several ranks, or engine=pipeline:
    DeepSpeed needs torch.distributed even for one rank), prepared data and the vocabulary size. ``log`` is
    kept on rank 0 only."""
    from asyncpipe.data import load_manifest
    from asyncpipe.runtime.device import pick_device, set_deterministic, vocab_size_for

    env = rank_env()
    rank, world, local = env if env is not None else (0, 1, 0)
    if cfg.engine == "pipeline" and env is None:
        raise UserError(
            "engine=pipeline ranks need RANK and WORLD_SIZE in the environment (torchrun, SLURM, asyncpipe)"
        )
    say = log if rank == 0 else _silent
    set_deterministic(cfg.train.deterministic)
    device = pick_device(cfg.device)  # the run's one device choice (on CUDA: made current, LOCAL_RANK set)
    if world > 1 or cfg.engine == "pipeline":
        _join_process_group(cfg, device, local)
    data_dir = _prepared_data(cfg, rank, world, say)
    manifest = load_manifest(data_dir)
    vocab = vocab_size_for(cfg.model, manifest)
    return Setup(rank, world, local, device, data_dir, vocab, say, train_tokens=int(manifest["tokens"]["train"]))


def _silent(_: str) -> None:
    pass


def _join_process_group(cfg: DictConfig, device: Any, local: int) -> None:
    """The run's one process-group set-up: torch.distributed's default group from the rank environment, and for
    engine=pipeline DeepSpeed's comm over it (`init_deepspeed_comm`)."""
    import torch

    from asyncpipe.dist import backend_for, init_process_group

    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing and not torch.distributed.is_initialized():
        need = " and ".join(missing)
        raise UserError(f"a multi-process run needs {need} in the environment (the rendezvous of rank 0)")
    os.environ.setdefault("LOCAL_RANK", str(local))  # DeepSpeed's PipelineModule reads it (CUDA: `pick_device` set it)
    pipeline = cfg.engine == "pipeline"
    backend = backend_for(device.type, cfg.pipeline.backend if pipeline else "auto")
    if pipeline:
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator
        torch.set_num_threads(cfg.pipeline.threads)
    init_process_group(backend)
    if pipeline:
        init_deepspeed_comm(backend)


def init_deepspeed_comm(backend: str) -> None:
    """DeepSpeed's comm over torch.distributed's default group (set up just before).

    DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce op on CPU (~30-40 s) that only its
    inference all-reduce uses; marking the op unavailable skips the build (its sole check reads this dict).
    """
    import logging

    import deepspeed.ops as ds_ops

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    compat = vars(ds_ops).get("__compatible_ops__")
    if compat is None:
        ds_ops.__compatible_ops__ = {"deepspeed_shm_comm": False}  # also skips probing every other op
    else:
        compat["deepspeed_shm_comm"] = False
    from deepspeed import comm as ds_comm

    ds_comm.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)


def _prepared_data(cfg: DictConfig, rank: int, world: int, log: Log) -> Path:
    """The run's one data preparation: rank 0 prepares (or finds) the dataset while the others wait, rather than
    race to write the same files; a user error there (a missing corpus) is raised on every rank."""
    from asyncpipe.data import dataset_dir, ensure_prepared

    path, error = None, None
    if rank == 0:
        try:
            path = ensure_prepared(cfg.data, cfg.tokenizer, progress=log)
        except UserError as err:
            error = str(err)
    first = next((e for e in Comm(world).gather(error) if e), None)  # the others wait here for rank 0
    if first is not None:
        raise UserError(first)
    return path if path is not None else dataset_dir(cfg.data, cfg.tokenizer)
