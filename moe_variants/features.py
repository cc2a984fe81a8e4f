"""Model features megatron-core 0.16.1 lacks for some pretrained families, as subclasses.

* ``MLADotProductAttention``: multi-latent attention with megatron-core's local (non-Transformer
  Engine) modules. ``MLASelfAttention`` builds its core attention with ``k_channels`` and
  ``v_channels`` (``multi_latent_attention.py:155-166``) because query/key heads
  (``qk_head_dim + qk_pos_emb_head_dim``) are wider than value heads (``v_head_dim``), but the local
  ``DotProductAttention`` accepts neither (``dot_product_attention.py:43-52``), so MLA could only
  be built with Transformer Engine. This subclass takes them and sizes its output by the value
  heads; the attention arithmetic is the parent's.
* ``GroupMaxRouter``: DeepSeek-V2's ``group_limited_greedy`` routing. megatron-core ranks a group
  by the sum of its top ``topk / group_topk`` scores (``moe_utils.py:553-555``, DeepSeek-V3); V2
  ranks it by its best expert. The two agree only when ``topk == group_topk``. The router's
  top-k selection is substituted through the ``router_replay`` argument of
  ``topk_routing_with_score_function`` (``moe_utils.py:699-707``), the one place megatron-core
  lets a router choose its experts; everything else (scores, scaling, aux losses) is upstream's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from moe_variants.common.moe_layer import ProjectRouter

__all__ = ["MLADotProductAttention", "GroupMaxRouter", "group_max_topk"]


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` for query/key heads of ``k_channels`` and value heads of ``v_channels``."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def group_max_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """DeepSeek-V2's group-limited greedy top-k.

    scores: [T, E] (softmax scores, or logits: the selection only compares them). Experts are split
    into ``num_groups`` consecutive groups; each token keeps the ``group_topk`` groups with the
    highest maximum score and takes its ``topk`` best experts among them.
    Returns (values [T, K], indices [T, K]).
    """
    num_tokens, num_experts = scores.shape
    group_scores = scores.view(num_tokens, num_groups, -1).max(dim=-1).values  # [T, G]
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


class _GroupMaxSelection:
    """The ``router_replay`` protocol (``get_replay_topk``) answering with ``group_max_topk``."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if not group_topk:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return group_max_topk(scores, topk, num_groups, group_topk)


class GroupMaxRouter(ProjectRouter):
    """``ProjectRouter`` whose group-limited top-k ranks a group by its best expert (DeepSeek-V2)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.router_replay is not None:
            raise ValueError("--moe-router-group-score max cannot be combined with routing replay")
        self.router_replay = _GroupMaxSelection()
