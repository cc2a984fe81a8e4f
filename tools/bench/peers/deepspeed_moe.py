"""DeepSpeed-MoE as an EP benchmark peer (bench variant ``deepspeed-moe``).

The model worker builds the same GPT as ``standard`` (same config, seed and initial weights) and,
before DDP wraps it, replaces the routed part of every MoE layer (router, experts, dispatcher) with
``deepspeed.moe.layer.MoE`` of the same hidden size ``H``, expert count ``E``, top-k ``K`` and
expert-parallel group, and copies our weights into it:

* gate: DeepSpeed's ``TopKGate.wg`` [E, H] is our router's weight (no bias in either; fp32 logits);
* experts: :class:`SwiGLUExpert`, the same SwiGLU expert as ours (``fc1`` [2F, H], ``silu(a) * b``,
  ``fc2`` [H, F], no bias: the same parameter count); global expert ``r * E/D + i`` lives on EP rank
  ``r`` in both stacks, so each rank keeps its own experts' weights;
* capacity, from the model's ``--moe-expert-capacity-factor`` (the same flag sets megatron-core's
  own dropping for ``standard``, so both stacks run the same mode side by side):
  - unset (dropless): ``drop_tokens=False``. DeepSpeed all-reduces (MAX) the largest per-expert
    token count over the EP group and pads every expert's buffer to it, so nothing is dropped;
  - ``cf`` set: ``drop_tokens=True, capacity_factor=eval_capacity_factor=cf`` (DeepSpeed's usual
    mode; its default cf is 1.0): every expert's buffer holds ``C = ceil(cf x T x K / E)`` rows,
    megatron-core's capacity for the same cf, and the pairs beyond it are dropped. Which pairs
    differ: DeepSpeed's top-2 gate keeps the first choices first, then the second, each in token
    order, and renormalises a token's remaining weight over its kept experts (its top-k gate for
    k > 2 keeps each expert's highest-probability pairs); megatron-core's default ``probs`` policy
    keeps each expert's highest-probability pairs and does not renormalise.
  Either way the whole ``[E, C, H]`` buffer crosses the all-to-all with equal splits: that padding
  is the volume difference from our dispatcher, which sends exactly the kept rows with uneven
  splits;
* ``top2_2nd_expert_sampling=False`` (DeepSpeed's default picks the second expert with Gumbel
  noise), ``use_rts=False``, no noisy gate. DeepSpeed's routing is then the top-k of the softmax,
  renormalised over the chosen k: for K >= 2 that is exactly ours (top-k logits, then softmax over
  them); for K = 1 DeepSpeed weights the expert output by the full-softmax probability, which ours
  does only with ``--moe-router-pre-softmax``;
* the shared expert stays ours (DeepSpeed-MoE has none; its "residual MoE" mixes differently),
  computed first and added as megatron-core's ``MoELayer`` does;
* the load-balancing loss is DeepSpeed's ``l_aux`` (GShard form) times ``--moe-aux-loss-coeff``,
  attached with megatron-core's ``MoEAuxLossAutoScaler`` like ours and logged as
  ``load_balancing_loss``; its value differs from megatron-core's switch form (DeepSpeed counts
  only the first choice), its communication does not exist.

**Counting.** DeepSpeed's ``MOELayer.forward`` sends its buffer with
``deepspeed.moe.sharded_moe._AllToAll.apply(group, buffer)``, twice per layer (dispatch, then
combine). :func:`install_counting` replaces that class, in the worker process only, with
:class:`CountedAllToAll`, which sends the same tensor with the same equal splits through the
project's ``moe_variants.common.comm.all_to_all``: bytes (the off-rank share of the padded buffer),
in-flight and exposed time, forward and backward, are then counted by the very code that counts
our dispatchers. A layer that saw fewer or more than two calls fails loudly (an upstream change
would otherwise read as zero bytes). The 8-byte capacity all-reduce before dispatch is not counted,
as our dispatcher's token-count exchange is not.

Shape legend: ``T`` tokens (sequence x micro-batch), ``H`` hidden, ``E`` experts, ``C`` capacity
(rows per expert buffer), ``F`` expert FFN size, ``D`` EP ranks.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = [
    "refusal",
    "WorkerHooks",
    "SwiGLUExpert",
    "DeepSpeedMoELayer",
    "CountedAllToAll",
    "install_counting",
    "init_deepspeed_comm",
    "replace_moe_layers",
    "model_refusal",
]

VARIANT = "deepspeed-moe"
INSTALL_HINT = "pip install -e '.[deepspeed]'"


def refusal(variant: str, device: str, ranks: int) -> Optional[str]:
    """One line naming what is missing for the peer, or None (see ``tools.bench.peers.refusal``)."""
    from tools.bench.peers import have_module

    if not have_module("deepspeed"):
        return f"--variants {variant} needs DeepSpeed, which is not installed ({INSTALL_HINT})"
    if device != "cpu":
        return f"--variants {variant} runs on the CPU (gloo) in this benchmark; drop --device {device}"
    return None


def model_refusal(model, parallel) -> Optional[str]:
    """Why the configured model cannot be matched by DeepSpeed-MoE, naming the flag, or None."""
    if not model.is_moe:
        return "the model has no MoE layers (--num-experts)"
    if not model.swiglu:
        return "the peer's experts are SwiGLU like ours: use --swiglu"
    checks = (
        (model.moe_router_score_function != "softmax", "--moe-router-score-function must be softmax"),
        (model.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor is not supported"),
        (model.moe_router_num_groups is not None, "--moe-router-num-groups (group-limited routing) is not supported"),
        (model.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias is not supported"),
        (bool(model.moe_z_loss_coeff), "--moe-z-loss-coeff is not supported"),
        (model.moe_router_load_balancing_type != "aux_loss", "--moe-router-load-balancing-type must be aux_loss"),
        (model.moe_router_topk == 1 and not model.moe_router_pre_softmax,
         "top-1 routing weighs the expert by the full softmax in DeepSpeed: add --moe-router-pre-softmax"),
        (parallel.tensor_model_parallel_size != 1 or parallel.expert_tensor_parallel_size != 1,
         "the peer runs with --tensor-model-parallel-size 1 and --expert-tensor-parallel-size 1"),
        (model.moe_token_dispatcher_type.value != "alltoall", "--moe-token-dispatcher-type must be alltoall"),
    )  # fmt: skip
    from moe_variants import registry

    for variant in registry.enabled(model):
        return f"variant {variant.name} is enabled; the peer replaces the standard MoE layer only"
    for bad, message in checks:
        if bad:
            return message
    return None


def _torch():
    import torch

    return torch


class _Lazy:
    """Classes that subclass torch/megatron types are defined on first use (the module stays light)."""

    classes: dict = {}


def _define():
    if _Lazy.classes:
        return _Lazy.classes
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker

    from moe_variants.common.comm import CommCounters, all_to_all

    class SwiGLUExpert(torch.nn.Module):
        """Our expert MLP as a plain module DeepSpeed can copy: ``fc2(silu(a) * b)``, ``[a, b] = fc1(x)``.

        x [..., H] -> fc1 [..., 2F] -> [..., F] -> fc2 [..., H]; no bias (megatron-core's
        ``add_bias_linear=False``), the same parameters as a megatron-core SwiGLU expert.
        """

        def __init__(self, hidden_size: int, ffn_hidden_size: int, dtype=torch.float32):
            super().__init__()
            self.fc1 = torch.nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False, dtype=dtype)
            self.fc2 = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype)

        def forward(self, x):
            a, b = torch.chunk(self.fc1(x), 2, dim=-1)
            return self.fc2(F.silu(a) * b)

    class CountedAllToAll:
        """Stands in for ``deepspeed.moe.sharded_moe._AllToAll`` (``apply(group, tensor)``, equal
        splits along dim 0) and counts through ``moe_variants.common.comm`` into the calling layer's
        counters (set by :class:`DeepSpeedMoELayer` for the duration of its forward)."""

        active = None  # the _LayerCall of the DeepSpeedMoELayer forward in progress

        @staticmethod
        def apply(group, tensor):
            call = CountedAllToAll.active
            if call is None:
                raise RuntimeError("DeepSpeed all-to-all outside a DeepSpeedMoELayer forward: nothing to count it in")
            if call.calls >= 2:
                raise RuntimeError("DeepSpeed's MOELayer made more than two all-to-alls in one forward: "
                                   "the peer's dispatch/combine accounting no longer matches it")
            kind = ("dispatch", "combine")[call.calls]
            call.calls += 1
            num_ranks = group.size()
            rows = tensor.shape[0]  # [E, C, H]: expert buffers, E/D to each rank
            assert rows % num_ranks == 0, (rows, num_ranks)
            if kind == "dispatch":
                call.buffer_rows += rows * tensor.shape[1]
            splits = [rows // num_ranks] * num_ranks
            return all_to_all(group, tensor, splits, splits, counters=call.counters, kind=kind)

    class _LayerCall:
        def __init__(self, counters):
            self.counters = counters
            self.calls = 0
            self.buffer_rows = 0

    class DeepSpeedMoELayer(MegatronModule):
        """A ``TransformerLayer.mlp`` made of DeepSpeed's MoE (routed experts) and our shared expert.

        ``forward(hidden_states [S, B, H]) -> (output [S, B, H], None)`` like megatron-core's
        ``MoELayer``. ``moe_comm_counters`` are found by ``moe_variants.common.moe_layer.comm_counters``,
        so the training step reports them like ours. ``routed_rows`` / ``kept_rows`` / ``buffer_rows``
        accumulate the (token, expert) pairs routed and kept by the capacity (read off the gate's
        routes: an evicted route has expert index -1) and the rows of the padded dispatch buffer
        since ``reset_padding``.
        """

        def __init__(self, config, moe, shared_experts, layer_number: int, aux_loss_coeff: float, num_layers: int):
            super().__init__(config)
            self.moe = moe
            self.shared_experts = shared_experts
            self.layer_number = layer_number
            self.aux_loss_coeff = aux_loss_coeff
            self.num_layers = num_layers
            self.ep_size = moe.ep_size
            self.topk = moe.deepspeed_moe.gate.k
            self.moe_comm_counters = CommCounters()
            self.routed_rows = self.kept_rows = self.buffer_rows = 0
            moe.deepspeed_moe.gate.register_forward_hook(self._count_kept)

        def _count_kept(self, gate, args, output) -> None:
            indices = output[3]  # [K, T] int32 (sparse routes, MOELayer's call): -1 where evicted
            if indices.dim() != 2:
                raise RuntimeError("DeepSpeed's gate no longer returns sparse routes: the kept-row count would be wrong")
            self.kept_rows += int((indices >= 0).sum())

        def reset_padding(self) -> None:
            self.routed_rows = self.kept_rows = self.buffer_rows = 0

        def forward(self, hidden_states, padding_mask=None, **kwargs):
            if padding_mask is not None:
                raise ValueError("the deepspeed-moe peer does not take a padding mask")
            shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
            call = _LayerCall(self.moe_comm_counters)
            previous, CountedAllToAll.active = CountedAllToAll.active, call
            try:
                output, l_aux, _ = self.moe(hidden_states)
            finally:
                CountedAllToAll.active = previous
            if self.ep_size > 1 and call.calls != 2:
                raise RuntimeError(f"DeepSpeed's MOELayer made {call.calls} counted all-to-alls (expected 2): "
                                   "sharded_moe._AllToAll is no longer what it calls")
            num_tokens = hidden_states.shape[0] * hidden_states.shape[1]
            self.routed_rows += num_tokens * self.topk
            self.buffer_rows += call.buffer_rows
            if self.training and self.aux_loss_coeff > 0:
                save_to_aux_losses_tracker("load_balancing_loss", l_aux.detach(), self.layer_number, self.num_layers)
                output = MoEAuxLossAutoScaler.apply(output, l_aux * self.aux_loss_coeff)
            if shared is not None:
                output = output + shared
            return output, None

    _Lazy.classes = dict(SwiGLUExpert=SwiGLUExpert, CountedAllToAll=CountedAllToAll,
                         DeepSpeedMoELayer=DeepSpeedMoELayer)  # fmt: skip
    return _Lazy.classes


def __getattr__(name):  # the lazily defined classes, as module attributes
    if name in ("SwiGLUExpert", "CountedAllToAll", "DeepSpeedMoELayer"):
        return _define()[name]
    raise AttributeError(name)


def use_the_environments_ninja() -> None:
    """Put this Python environment's ``ninja`` (installed with DeepSpeed) first on PATH when it has
    one. DeepSpeed JIT-builds its ops (on CPU: ``shm_comm``) with whichever ``ninja`` PATH finds
    first, and two ninja versions (this one and a system one) read each other's build logs as
    changed commands: a process started with the environment's bin on PATH and one started without
    it would rebuild the op (about a minute on 2 cores) each time they alternate."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bindir, "ninja")) and path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path if path else bindir


def import_deepspeed():
    """``import deepspeed`` with the CPU accelerator when there is no GPU (``DS_ACCELERATOR=cpu``),
    building its ops with this environment's ninja."""
    use_the_environments_ninja()
    torch = _torch()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.moe import sharded_moe  # noqa: F401
    except ImportError as e:
        raise ValueError(f"the deepspeed-moe peer needs DeepSpeed ({INSTALL_HINT}): {e}") from None
    return deepspeed


def init_deepspeed_comm() -> None:
    """DeepSpeed's communication backend on the existing torch.distributed group (its capacity
    all-reduce goes through ``deepspeed.comm``); a no-op when already initialised."""
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo" if not _torch().cuda.is_available() else "nccl",
                               auto_mpi_discovery=False)  # fmt: skip


def install_counting() -> None:
    """Route DeepSpeed-MoE's all-to-alls through :class:`CountedAllToAll` (this process only)."""
    import_deepspeed()
    from deepspeed.moe import sharded_moe

    sharded_moe._AllToAll = _define()["CountedAllToAll"]


def _copy_layer_weights(ds_moe, ours) -> None:
    """Our router and local experts' weights into DeepSpeed's gate and experts (same function)."""
    torch = _torch()
    gate = ds_moe.deepspeed_moe.gate.wg.weight
    local = ds_moe.deepspeed_moe.experts.deepspeed_experts
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_variants.common.experts import GroupedExperts, local_expert_weights

    if not isinstance(ours.experts, (GroupedExperts, SequentialMLP)):
        raise ValueError(f"the deepspeed-moe peer copies weights from the local spec's experts, "
                         f"not {type(ours.experts).__name__} (use --transformer-impl local)")  # fmt: skip
    experts = local_expert_weights(ours.experts)
    if len(experts) != len(local):
        raise ValueError(f"{len(experts)} local experts here, {len(local)} in DeepSpeed's layer")
    with torch.no_grad():
        gate.copy_(ours.router.weight)
        for theirs, (fc1, fc2) in zip(local, experts):
            theirs.fc1.weight.copy_(fc1)
            theirs.fc2.weight.copy_(fc2)


def replace_moe_layers(model, model_cfg, pg_collection) -> list:
    """Replace every MoE layer's routed part in ``model`` (a bare ``GPTModel``) by DeepSpeed-MoE with
    the same weights; returns the new layers. Call on every rank (DeepSpeed creates its EP group)."""
    import_deepspeed()
    from deepspeed.moe.layer import MoE
    from megatron.core.transformer.moe.moe_layer import MoELayer

    torch = _torch()
    classes = _define()
    init_deepspeed_comm()
    install_counting()
    ep_ranks = torch.distributed.get_process_group_ranks(pg_collection.ep)
    ep_size = len(ep_ranks)
    dtype = torch.bfloat16 if model_cfg.bf16 else torch.float32
    ffn = model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size
    cf = model_cfg.moe_expert_capacity_factor  # None: dropless
    layers = []
    for layer in model.decoder.layers:
        ours = layer.mlp
        if not isinstance(ours, MoELayer):
            continue
        expert = classes["SwiGLUExpert"](model_cfg.hidden_size, ffn, dtype=dtype)
        ds = MoE(
            model_cfg.hidden_size, expert, num_experts=model_cfg.num_experts, ep_size=ep_size,
            k=model_cfg.moe_router_topk, min_capacity=0, drop_tokens=cf is not None, use_rts=False,
            capacity_factor=cf or 1.0, eval_capacity_factor=cf or 1.0,
            noisy_gate_policy=None, use_residual=False, top2_2nd_expert_sampling=False,
        )  # fmt: skip
        ds.set_deepspeed_parallelism()
        got = torch.distributed.get_process_group_ranks(ds.deepspeed_moe.ep_group)
        if got != ep_ranks:
            raise ValueError(f"DeepSpeed's EP group {got} is not megatron-core's {ep_ranks}: expert placement "
                             "would differ from the gradient reduction's")  # fmt: skip
        _copy_layer_weights(ds, ours)
        if model_cfg.bf16:
            ds.to(torch.bfloat16)
        shared = getattr(ours, "shared_experts", None)
        new = classes["DeepSpeedMoELayer"](
            ours.config, ds, shared, layer_number=layer.layer_number, aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            num_layers=ours.config.num_layers,
        )  # fmt: skip
        layer.mlp = new
        layers.append(new)
    if not layers:
        raise ValueError("the model has no MoE layer to replace")
    return layers


def padding_stats(model_chunks) -> dict:
    """Rows routed, kept (capacity) and sent (padded buffers) since the last reset, summed over this
    rank's peer layers, and reset them: ``{"routed_rows", "kept_rows", "buffer_rows"}``."""
    classes = _define()
    out = {"routed_rows": 0, "kept_rows": 0, "buffer_rows": 0}
    for chunk in model_chunks:
        for m in chunk.modules():
            if isinstance(m, classes["DeepSpeedMoELayer"]):
                for key in out:
                    out[key] += getattr(m, key)
                m.reset_padding()
    return out


class WorkerHooks:
    """What the model worker does differently for ``deepspeed-moe`` (see tools.bench.variant_worker)."""

    def __init__(self, configs, pg_collection, options: dict):
        reason = model_refusal(configs.model, configs.parallel)
        if reason is not None:
            raise ValueError(f"--variants {VARIANT}: {reason}")
        self.configs = configs
        self.pg_collection = pg_collection
        self.layers: list = []

    build_kwargs: dict = {}
    forward_step_factory = None

    def before_wrap(self, model) -> None:
        self.layers = replace_moe_layers(model, self.configs.model, self.pg_collection)

    def step_extra(self, model_chunks) -> dict:
        """Per-step extras for the rank result: the padded dispatch buffer vs the routed rows."""
        return padding_stats(model_chunks)
