"""FCSD distillation losses (FarSkip-Collective paper Eq. 3-5, Table 2), vocabulary-parallel.

Logits arrive sharded over the vocabulary across tensor-parallel ranks ([..., V/TP] each). The
softmax normaliser is assembled with an all-reduce of the per-shard maximum and of the per-shard
sum of exponentials (autograd all-reduce: summed in the backward too, because every shard's KL
terms depend on it); the KL sum over the vocabulary is a per-shard partial sum all-reduced with
megatron-core's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward
identity: every TP rank holds the same loss and back-propagates into its own shard). The result
is the gradient p_student - p_teacher on each rank's slice, as with megatron-core's vocab-parallel
cross entropy. With TP=1 these are plain log-softmax and KL.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.common import collectives

__all__ = ["vocab_parallel_log_softmax", "kl_divergence", "hidden_state_l2", "masked_token_mean"]


def _tp_group():
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_log_softmax(logits: torch.Tensor, group=None) -> torch.Tensor:
    """log-softmax over a vocabulary split across ``group`` along the last dim (fp32)."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    if group is not None:
        collectives.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max
    sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
    if group is not None:
        # every rank's partial KL depends on every shard through the normaliser, so its gradient
        # must be summed over ranks too: all-reduce forward *and* backward
        sum_exp = collectives.all_reduce_autograd(sum_exp, group=group)
    return shifted - sum_exp.log()


def masked_token_mean(per_token: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def kl_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    group="auto",
) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) = sum_v p_t (log p_t - log p_s) (Eq. 4).

    ``*_logits``: [..., V/TP]; ``mask``: [...] (1 = scored). With a temperature T both
    distributions are softened and the loss is scaled by T^2 (Hinton et al.), so gradients keep
    their magnitude. Teacher gradients are never needed: pass detached teacher logits.
    """
    group = _tp_group() if group == "auto" else group
    log_s = vocab_parallel_log_softmax(student_logits / temperature, group)
    log_t = vocab_parallel_log_softmax(teacher_logits.detach() / temperature, group)
    per_token = _reduce_sum((log_t.exp() * (log_t - log_s)).sum(dim=-1), group)
    return masked_token_mean(per_token, mask) * temperature**2


def hidden_state_l2(student: list, teacher: list, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over layers of the per-token mean squared error of hidden states (Table 2's
    "KL + inter. L2"). Lists of [s, b, h] tensors; ``mask`` is [b, s] (1 = scored)."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden states: {len(student)} student vs {len(teacher)} teacher layers")
    terms = []
    for s, t in zip(student, teacher):
        per_token = (s.float() - t.detach().float()).pow(2).mean(dim=-1).transpose(0, 1)  # [b, s]
        m = None if mask is None or mask.shape != per_token.shape else mask
        terms.append(masked_token_mean(per_token, m))
    return torch.stack(terms).mean()


def student_ce(logits_bsv: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [b, s] of vocabulary-parallel logits [b, s, V/TP]."""
    return tensor_parallel.vocab_parallel_cross_entropy(
        logits_bsv.transpose(0, 1).contiguous().float(), labels.transpose(0, 1).contiguous()
    ).transpose(0, 1)
