"""When a GPU-tier check may be skipped instead of failed: only for NCCL's refusal of two ranks on
one device, and only where the ranks really share one (fewer GPUs than ranks). A plain CPU module:
``test_skip_rule.py`` checks the rule on every machine."""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["NCCL_DEBUG_ENV", "shared_gpu_refusal"]

# NCCL's own line for two ranks on one device ("Duplicate GPU detected : rank 1 and rank 0 both on
# CUDA device 1d000"); torch reports it as ncclInvalidUsage, the code every misuse of NCCL gets, so
# that code alone says nothing about the cause
_DUPLICATE_GPU = re.compile(r".*Duplicate GPU detected.*")
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "WARN"}  # NCCL prints its warning lines, the duplicate-GPU one among them


def shared_gpu_refusal(output: str, num_ranks: int, num_gpus: int) -> Optional[str]:
    """NCCL's duplicate-GPU line in a failed run's ``output`` when its ``num_ranks`` ranks shared
    ``num_gpus`` GPUs (the known condition a check may be skipped for); None for anything else."""
    if num_ranks <= num_gpus:
        return None
    found = _DUPLICATE_GPU.findall(output)
    return found[0].strip()[:240] if found else None
