"""Process groups and seeds: one call that every entry point and test makes before building models."""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron import compat
from moe_variants.config import ParallelConfig

__all__ = ["initialize_parallel", "init_from_env", "default_backend", "set_seed", "device", "single_process_group", "destroy_parallel"]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: Optional[str] = None, timeout_minutes: int = 10) -> None:
    """``init_process_group`` from the torchrun environment. For NCCL the rank's GPU is selected
    first (``LOCAL_RANK`` modulo the visible GPUs, so several ranks may share one): NCCL binds a
    communicator to the current device, which is otherwise GPU 0 for every local rank."""
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    timeout = datetime.timedelta(minutes=timeout_minutes)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun --max-restarts: the agent's store outlives an attempt, and a restarted gloo
        # group would read the dead attempt's addresses from it (connectFullMesh refused). Each
        # attempt gets its own key space.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and, through megatron-core's tracker, CUDA)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU the CUDA RNG tracker cannot hold states (random.py:235-238 calls
    # torch.cuda.get_rng_state); the inference tracker's fork() is a no-op, so dropout and
    # initialisation fall back to the CPU generator seeded above.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )


def initialize_parallel(
    parallel: ParallelConfig,
    *,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_minutes: float = 10,
):
    """Initialise torch.distributed (if needed), megatron-core's model-parallel groups and seeds.

    Reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) when the default process
    group does not exist yet. Returns megatron-core's ``ProcessGroupCollection`` for the layout.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    compat.apply()
    if not dist.is_initialized():
        init_from_env(backend, timeout_minutes)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    # megatron-LM offsets the seed per pipeline stage so stages do not initialise identically
    set_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_parallel() -> None:
    """Tear down megatron-core's model-parallel groups and the default process group (if any)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_group(*, only: Optional[str] = None, backend: str = "gloo"):
    """A world of one rank on a private file store, for tools that run in one process; torn down
    (with megatron-core's groups) on exit. An existing group (a test harness, torchrun) is used as it
    is; ``only`` names the tool for the one-line error when that group has more than one rank.
    ``backend``: gloo (the tools that move host tensors), or ``default_backend()`` for one that
    trains on the GPU (NCCL: gloo would stage every gradient reduction through the host)."""
    if dist.is_initialized():
        if only is not None and dist.get_world_size() != 1:
            raise ValueError(f"{only} runs in one process: run it without torchrun")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="pg-") as tmp:
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            destroy_parallel()
