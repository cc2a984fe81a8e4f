"""What the routers decide, observed: top-k traces, the local activation rate (LAR) and dropping.

All three install an observer on every ``ProjectRouter`` (``routing_observer``), so they work with any
variant's MoE layer. ``RouteRecorder`` keeps the last forward's top-k expert ids per MoE layer
(Sem-MoE profiling); ``LocalActivationCounter`` counts how many (token, expert) activations land on
the rank that holds the token (Sem-MoE's LAR; evaluate_lm reports it for every model).

Shape legend: ``L`` MoE layers, ``N`` experts, ``K`` top-k, ``S`` sequence, ``B`` batch, ``T``
tokens of a forward.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from moe_variants.common.moe_layer import moe_layers
from megatron.common import collectives

__all__ = ["RouteRecorder", "LocalActivationCounter", "DropCounter"]


class RouteRecorder:
    """Top-k expert ids (router order, best first) of every MoE layer in the last forward.

    Installs an observer on every router (``ProjectRouter``) while active (``with recorder:``).
    ``last[l]`` is this rank's [T_local, K] int64 tensor for MoE layer ``l``.
    """

    def __init__(self, model):
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no MoE layers")
        for m in self.layers:
            if not hasattr(m.router, "routing_observer"):
                raise ValueError(f"router {type(m.router).__name__} cannot report its routing (not a ProjectRouter)")
        self.top_k = int(self.layers[0].router.topk)
        self.num_experts = int(self.layers[0].config.num_moe_experts)
        self.last: list[Optional[torch.Tensor]] = [None] * len(self.layers)

    def __enter__(self):
        for l, m in enumerate(self.layers):
            m.router.routing_observer = functools.partial(self._observe, l)
        return self

    def __exit__(self, *exc):
        for m in self.layers:
            m.router.routing_observer = None
        return False

    def _observe(self, index: int, layer_number: int, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        chosen = routing_map.sum(1)
        if bool((chosen != self.top_k).any()):
            raise ValueError(
                f"MoE layer {index}: a token was routed to {int(chosen.min())}..{int(chosen.max())} experts, "
                f"not top-{self.top_k} (token dropping / capacity is not supported)"
            )
        scores = probs.float().masked_fill(~routing_map, float("-inf"))
        self.last[index] = torch.topk(scores, self.top_k, dim=1).indices

    def take(self, tp_group=None) -> list[torch.Tensor]:
        """[L] x [T, K] of the last forward, TP shards all-gathered (collective over ``tp_group``)."""
        if any(t is None for t in self.last):
            raise RuntimeError("a MoE layer did not report its routing in the last forward")
        out = list(self.last)
        self.last = [None] * len(self.layers)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            gathered = []
            for t in out:
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
                collectives.all_gather(parts, t.contiguous(), group=tp_group)
                gathered.append(torch.cat(parts, 0))
            out = gathered
        return out


class LocalActivationCounter:
    """Local activations of the forwards this rank runs, counted from the routers' top-k.

    An activation (token, routed expert) is local when megatron-core's contiguous expert split
    puts the expert on this EP rank, the rank that holds the token (attention-DP, TP = 1; for a
    Sem-MoE placed checkpoint the split *is* the tables' placement). Use ``with counter:`` around
    the forwards (it installs a :class:`RouteRecorder`) and call :meth:`count` after every forward
    with the mask of the tokens that count (padding and lockstep dummies are forwarded, routed and
    dispatched, but belong to no request). Totals over ranks: :meth:`summary` (collective).
    """

    def __init__(self, model, ep_rank: int, ep_size: int):
        self.recorder = RouteRecorder(model)
        n_exp = self.recorder.num_experts
        if n_exp % ep_size:
            raise ValueError(f"{ep_size} EP ranks do not split {n_exp} experts evenly")
        self.ep_rank = int(ep_rank)
        self.expert2device = torch.arange(n_exp) // (n_exp // ep_size)  # [N]
        num_layers = len(self.recorder.layers)
        self.local = np.zeros(num_layers, dtype=np.int64)  # [L] local activations of counted tokens
        self.total = np.zeros(num_layers, dtype=np.int64)  # [L] activations of counted tokens
        self.to_device = np.zeros((num_layers, ep_size), dtype=np.int64)  # [L, D] counted activations per device
        self.remote_all = 0  # remote (token, expert) rows over every forwarded token, pads included

    def __enter__(self):
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc):
        return self.recorder.__exit__(*exc)

    def count(self, real_BS: torch.Tensor) -> np.ndarray:
        """Count the last forward of tokens [B, S] (megatron routes them in [S, B] order);
        ``real_BS`` [B, S] bool marks the tokens to count. Returns [L, B] local activations of
        each row's counted tokens."""
        num_b, num_s = real_BS.shape
        real_SB = real_BS.t().cpu()
        k = self.recorder.top_k
        out = np.zeros((len(self.local), num_b), dtype=np.int64)
        for l, topk in enumerate(self.recorder.take()):
            dev_SBK = self.expert2device[topk.cpu()].view(num_s, num_b, k)
            hit_SBK = dev_SBK == self.ep_rank
            self.to_device[l] += np.bincount(dev_SBK[real_SB].reshape(-1).numpy(), minlength=self.to_device.shape[1])
            self.remote_all += int((~hit_SBK).sum())
            out[l] = (hit_SBK & real_SB[:, :, None]).sum((0, 2)).numpy()
            self.total[l] += int(real_SB.sum()) * k
        self.local += out.sum(1)
        return out

    def count_layers(self, real_per_layer: list) -> None:
        """Count the last forward when each MoE layer routed its own rows (Sem-MoE's Algorithm 3
        re-batches the tokens before every layer): ``real_per_layer[l]`` [T_l] bool marks the rows
        of layer ``l`` that are real tokens."""
        k = self.recorder.top_k
        for l, (topk, real) in enumerate(zip(self.recorder.take(), real_per_layer)):
            real = real.cpu()
            dev_TK = self.expert2device[topk.cpu()]
            hit_TK = dev_TK == self.ep_rank
            self.to_device[l] += np.bincount(dev_TK[real].reshape(-1).numpy(), minlength=self.to_device.shape[1])
            self.remote_all += int((~hit_TK).sum())
            self.local[l] += int((hit_TK & real[:, None]).sum())
            self.total[l] += int(real.sum()) * k

    def summary(self, group=None) -> dict:
        """LAR over the counted tokens of every rank of ``group`` (all-reduce; collective)."""
        t = torch.from_numpy(np.concatenate([self.local, self.total, [self.remote_all]])).double()
        collectives.all_reduce(t, group=group)
        num_layers = len(self.local)
        local, total = t[:num_layers].long().numpy(), t[num_layers:2 * num_layers].long().numpy()
        return {
            "lar": float(local.sum() / total.sum()) if total.sum() else None,
            "lar_per_layer": [float(a / b) if b else None for a, b in zip(local, total)],
            "local_activations": int(local.sum()),
            "activations": int(total.sum()),
            "remote_rows_all_tokens": int(t[-1]),
        }


class DropCounter:
    """(token, expert) pairs routed and kept by capacity dropping (``--moe-expert-capacity-factor``),
    summed over every MoE layer's forwards while active (``with counter:``).

    The router's map is observed after megatron-core's ``apply_router_token_dropping``, so a token
    routed to ``k`` experts counts ``k`` routed pairs and as many kept as survive its experts'
    capacity; dropless routing keeps all (with ``moe_pad_expert_input_to_capacity`` the map also
    holds the padding slots, so ``kept`` counts those too). :meth:`take` returns and resets the totals.
    """

    def __init__(self, model):
        chunks = model if isinstance(model, (list, tuple)) else [model]  # a model or its chunks
        self.layers = [m for chunk in chunks for m in moe_layers(chunk)]
        for m in self.layers:
            if not hasattr(m.router, "routing_observer"):
                raise ValueError(f"router {type(m.router).__name__} cannot report its routing (not a ProjectRouter)")
        self.routed = self.kept = 0

    def __enter__(self):
        for m in self.layers:
            m.router.routing_observer = self._observe
        return self

    def __exit__(self, *exc):
        for m in self.layers:
            m.router.routing_observer = None
        return False

    def _observe(self, layer_number: int, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        self.routed += int(routing_map.shape[0]) * int(self.layers[0].router.topk)  # [T, E]: T tokens
        # summed on the map's device, read once in take(): no host sync inside the step (on a GPU a
        # sync per layer would stall the launch queue and the overlap the benchmark measures)
        self.kept = self.kept + routing_map.sum()

    def take(self) -> dict:
        out = {"routed_rows": self.routed, "kept_rows": int(self.kept)}
        self.routed = self.kept = 0
        return out
