"""Model FLOPs per trained token, for TFLOP/s per GPU and MFU in the step line.

PaLM's definition (Chowdhery et al. 2022, App. B), the one MFU figures are quoted in: a trained
token costs ``6 N`` for the matrix multiplies of ``N`` active weights (forward 2, backward 4) plus
``6 L s H (d_qk + d_v)`` for the attention scores and their use (``12 L H Q s`` when
``d_qk = d_v = Q``), with no causal discount and no recomputation counted. For an MoE, ``N`` counts
the dense weights and ``top-k`` of the routed experts; embedding lookups are not multiplies and
are left out, the output projection is in. ``N`` is counted from the built model, so every
variant's own shapes (BigMac's projections, MLA's low-rank matrices, shared experts) are counted
as built, not as a formula assumes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron.common import collectives

if TYPE_CHECKING:
    from megatron.components.arguments import Configs

__all__ = ["active_weights", "flops_per_token", "PEAK_BF16_TFLOPS", "peak_tflops", "HBM_TB_S", "hbm_bandwidth",
           "Throughput"]

# dense bf16 peak of the accelerators MFU is usually quoted for (vendor data sheets, no sparsity)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0,
                    "B200": 2250.0, "GB200": 2500.0, "L40S": 362.1, "MI300X": 1307.4}

# HBM bandwidth (TB/s) of the same accelerators (vendor data sheets; the longest name found in the
# device's name wins): the bound of a memory-bound step such as a decode step
HBM_TB_S = {"H200": 4.8, "H100": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H800": 3.35, "A100-SXM4-80GB": 2.039,
            "A100 80GB PCIe": 1.935, "A100": 1.555, "B200": 8.0, "GB200": 8.0, "L40S": 0.864, "MI300X": 5.3}


def _device_entry(table: dict) -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key in sorted(table, key=len, reverse=True):
        if key in name:
            return table[key]
    return None


def active_weights(model, *, num_experts: Optional[int], topk: int, num_local_experts: int, tp_size: int = 1,
                   expert_tp_size: int = 1) -> int:
    """Weights one token multiplies by in the whole model (not this rank's shard): matrices only
    (norm scales and biases are element-wise), without the embedding tables unless they are
    also the output projection. Expert weights sit under ``.experts.`` (and carry
    ``allreduce=False`` at EP > 1); tensor-parallel shards carry ``tensor_model_parallel=True``.
    ``num_local_experts`` (the experts this rank holds) has no default: the expert weights summed
    here are divided by it to get one expert's, so a wrong count multiplies the routed FLOPs."""
    dense, expert = 0, 0
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        if "embedding" in name and not (tied and "word_embeddings" in name):
            continue
        if not getattr(p, "allreduce", True) or ".experts." in name:  # megatron-core marks them only at EP > 1
            expert += p.numel() * expert_tp_size
        else:
            dense += p.numel() * (tp_size if getattr(p, "tensor_model_parallel", False) else 1)
    per_expert = expert // max(num_local_experts, 1)
    return dense + (topk * per_expert if num_experts else 0)


def flops_per_token(config, active: int, *, seq_length: int) -> float:
    """Training FLOPs of one token (module docstring) of a model with ``active`` weights per token
    (``active_weights``, summed over pipeline stages); ``config`` is megatron-core's
    ``TransformerConfig``."""
    if getattr(config, "multi_latent_attention", False):
        d_qk = config.qk_head_dim + config.qk_pos_emb_head_dim
        d_v = config.v_head_dim
    else:
        d_qk = d_v = config.kv_channels
    attention = 6 * config.num_layers * seq_length * config.num_attention_heads * (d_qk + d_v)
    return 6.0 * active + attention


def peak_tflops(bf16: bool) -> Optional[float]:
    """This GPU's dense bf16 peak from ``PEAK_BF16_TFLOPS`` (None on CPU, for fp32 models and for
    unknown GPUs: pass ``--peak-tflops``)."""
    return _device_entry(PEAK_BF16_TFLOPS) if bf16 else None


def hbm_bandwidth() -> Optional[float]:
    """This GPU's HBM bandwidth in TB/s from ``HBM_TB_S`` (None on CPU and for unknown GPUs)."""
    return _device_entry(HBM_TB_S)


class Throughput:
    """TFLOP/s per GPU, MFU and peak GPU memory of a logged step (``megatron/training/flops.py``)."""

    def __init__(self, flops_per_token: float, world_size: int, peak: Optional[float]):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak = peak

    @classmethod
    def of(cls, model, c: Configs, world_size: int) -> "Throughput":
        from megatron.core import parallel_state

        p = c.parallel
        num_local = (c.model.num_experts or 0) // max(p.expert_model_parallel_size, 1)
        active = torch.tensor([float(active_weights(
            model, num_experts=c.model.num_experts, topk=c.model.moe_router_topk or 0,
            tp_size=p.tensor_model_parallel_size, expert_tp_size=p.expert_tensor_parallel_size or 1,
            num_local_experts=max(num_local, 1)))], dtype=torch.float64)
        if p.pipeline_model_parallel_size > 1:  # each stage counts its own layers
            collectives.all_reduce(active, group=parallel_state.get_pipeline_model_parallel_group())
        per_token = flops_per_token(model.config, int(active.item()), seq_length=c.model.seq_length)
        return cls(per_token, world_size, c.training.peak_tflops or peak_tflops(c.model.bf16))

    def record(self, m) -> dict:
        out = {}
        if m.step_time_s > 0:
            tflops = self.flops_per_token * m.tokens / m.step_time_s / self.world_size / 1e12
            out["tflops_per_gpu"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        if torch.cuda.is_available():
            out["gpu_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out
