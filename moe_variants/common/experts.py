"""Routed experts as grouped GEMMs in plain torch (``torch.nn.functional.grouped_mm``).

megatron-core's local ``SequentialMLP`` runs a Python loop over the experts: two matmuls per
expert, a host sync for the split sizes, and a kernel launch pattern that leaves a GPU mostly
idle at fine-grained sizes. ``GroupedExperts`` runs each projection of all local experts as one
grouped GEMM over the expert-sorted tokens, with the group offsets computed on the device from
``tokens_per_expert`` (no ``.item()``/``.tolist()`` on its path). On an sm90 GPU the bf16 kernel
is CUTLASS's (bf16 in and out, fp32 accumulation); on the CPU torch has a kernel for 16-byte
aligned strides (per-group matmuls with the CPU GEMM's own accumulation).

Parameters are stacked per projection: ``fc1_weight`` [E, 2F/tp, H_in] and ``fc2_weight``
[E, H_in, F/tp], expert ``e`` of each being ``SequentialMLP``'s ``local_experts.e.linear_fc1.weight``
/ ``linear_fc2.weight`` ([out, in], the same tensor-parallel slice, the same initialisation from the
same seed). Stacking keeps one parameter per projection, so megatron-core's DDP buffers, the
distributed optimizer and ``main_grad`` see two large parameters instead of 2E small ones, and no
weight is copied per step (keeping per-expert parameters and stacking them each step would copy
every expert weight in every forward). Checkpoints are interchangeable with ``SequentialMLP``:
the checkpoint layout's adapter, ``moe_variants/common/state_dict/grouped_experts.py``, stores the
stacked parameters under its per-expert keys (``state_dict()`` and dist-checkpointing).

``RoutedExperts`` is the spec's expert module: it builds ``GroupedExperts`` where the kernel runs
(``grouped_gemm_refusal``) and ``SequentialMLP`` (or the given loop class) otherwise, recording why
on the module (``describe`` turns a model's choice into one line).

Shape legend: N routed token copies (sorted by expert), E local experts, H expert input/output
width (the hidden size, or BigMac's latent size), F expert FFN width, tp expert-TP size.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP

from moe_variants.common import wgrad
from moe_variants.common.state_dict import grouped_experts as checkpoint_layout

__all__ = ["GroupedExperts", "RoutedExperts", "grouped_gemm_refusal", "describe", "group_offsets",
           "grouped_linear", "local_expert_weights", "GROUPED", "LOOP"]

GROUPED = "grouped GEMM"  # GroupedExperts
LOOP = "SequentialMLP loop"


def _device() -> torch.device:
    """Where the model's parameters are built (``builder.build_model``: the current GPU, else CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _probe(device: torch.device, dtype: torch.dtype, in_size: int, fc1_out: int, ffn: int) -> Optional[str]:
    """Run the three grouped GEMMs of a forward and backward once at these widths (two experts,
    one empty); the kernel's refusal as one line, or None."""
    try:
        offs = torch.tensor([2, 2], dtype=torch.int32, device=device)
        x = torch.ones(2, in_size, dtype=dtype, device=device)
        for out, k in ((fc1_out, in_size), (in_size, ffn)):
            w = torch.ones(2, out, k, dtype=dtype, device=device)
            a = x if k == in_size else torch.ones(2, k, dtype=dtype, device=device)
            y = F.grouped_mm(a, w.transpose(1, 2), offs=offs)
            F.grouped_mm(y, w, offs=offs)
            F.grouped_mm(y.t(), a, offs=offs)
    except RuntimeError as e:
        return f"grouped_mm refuses {dtype} on {device.type}: {str(e).strip().splitlines()[0]}"
    return None


def grouped_gemm_refusal(config, device: Optional[torch.device] = None) -> Optional[str]:
    """Why ``GroupedExperts`` cannot run for megatron-core ``TransformerConfig`` ``config`` on
    ``device`` (default: where the model is built), or None. Checked: torch has ``grouped_mm``;
    the matrices' rows are multiples of 16 bytes (the kernels' stride rule); the kernel runs at
    these widths and this dtype (a tiny forward and backward, once per shape)."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if (config.add_bias_linear or config.fp8 or config.fp4 or config.use_te_activation_func
            or config.moe_apply_probs_on_input):
        return "expert biases, FP8/FP4, TE activations and probabilities on the input need the loop"
    device = _device() if device is None else device
    dtype = config.params_dtype
    tp = config.expert_tensor_parallel_size or 1
    in_size = config.moe_latent_size or config.hidden_size
    ffn = config.moe_ffn_hidden_size // tp
    fc1_out = ffn * (2 if config.gated_linear_unit else 1)
    size = torch.tensor([], dtype=dtype).element_size()
    for name, width in (("expert input/output width", in_size), ("expert FFN width per expert-TP rank", ffn)):
        if width * size % 16:
            return (f"the {name} {width} x {size} bytes is not a multiple of 16 bytes "
                    "(grouped_mm's stride rule)")
    return _probe(device, dtype, in_size, fc1_out, ffn)


def group_offsets(tokens_per_expert, device) -> torch.Tensor:
    """[E] int32 cumulative row offsets (``grouped_mm``'s ``offs``) on ``device``, without a host
    sync when ``tokens_per_expert`` is already there."""
    counts = torch.as_tensor(tokens_per_expert).to(device, non_blocking=True)
    return torch.cumsum(counts, 0, dtype=torch.int32)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e].T`` for every expert e (one grouped GEMM).

    The backward computes the input gradient at once; the weight gradient ``dy_e^T x_e``
    (one grouped GEMM over the same offsets) is computed here, accumulated into ``main_grad``
    with gradient-accumulation fusion (as megatron-core's local linears do), or, with deferral on,
    queued for ``moe_variants.common.wgrad`` to run later. The incoming gradient is made contiguous
    (a broadcast gradient, e.g. of ``y.sum()``, has zero strides, which the kernels reject).

    Edges the kernels do not guarantee, handled without a host sync: an expert with no rows gets a
    weight gradient of exactly 0 (its group of ``dy_e^T x_e`` is a zero-length contraction, which
    some GPUs' kernels leave unwritten: pytorch/pytorch#172439), by a ``masked_fill_`` on the
    device-side group sizes; no rows at all (N = 0, known from the shape on the host) calls no
    kernel: the output and the input gradient are empty, the weight gradient is zero.
    """

    @staticmethod
    def forward(ctx, x, weight, offs, owner):
        ctx.save_for_backward(x, weight, offs)
        ctx.defer = owner.defer_wgrad
        ctx.fuse = owner.config.gradient_accumulation_fusion
        if not x.shape[0]:
            return x.new_zeros(0, weight.shape[1])
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, offs = ctx.saved_tensors
        dy = grad_output.contiguous()
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = F.grouped_mm(dy, weight, offs=offs) if x.shape[0] else torch.zeros_like(x)
        if not ctx.needs_input_grad[1]:
            return grad_input, None, None, None

        def weight_grad():  # [E, out, in]
            if not x.shape[0]:
                return torch.zeros_like(weight)
            grad = F.grouped_mm(dy.t(), x, offs=offs)
            empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0  # [E], on the device
            return grad.masked_fill_(empty[:, None, None], 0)

        if ctx.defer:
            wgrad.queue(lambda: wgrad.accumulate(weight, weight_grad()))
            return grad_input, None, None, None
        if ctx.fuse:
            weight.main_grad.add_(weight_grad())
            if not hasattr(weight, "grad_added_to_main_grad"):
                return grad_input, None, None, None
            # megatron-core DDP: a placeholder gradient keeps its hook on this thread and tells
            # it the gradient is in main_grad already (tensor_parallel/layers.py:581-612)
            zero = getattr(weight, "zero_out_wgrad", False)
            make = torch.zeros if zero else torch.empty
            placeholder = make(weight.main_grad.shape, dtype=x.dtype, device=x.device)
            weight.grad_added_to_main_grad = True
            return grad_input, placeholder, None, None
        return grad_input, weight_grad(), None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, owner) -> torch.Tensor:
    """[N, in] x [E, out, in] -> [N, out] for expert-sorted rows delimited by ``offs``; ``owner``
    carries ``defer_wgrad`` and the config (see ``_GroupedLinear``)."""
    return _GroupedLinear.apply(x, weight, offs, owner)


class GroupedExperts(MegatronModule):
    """All local experts of an MoE layer as two grouped GEMMs (see the module docstring).

    ``forward(permuted [N, H], tokens_per_expert [E], probs [N]) -> ([N, H], None)`` like
    ``SequentialMLP``. The routing probabilities scale the activation [N, F] (megatron-core's
    ``per_token_scale``) or, with ``probs_on_output`` (BigMac's reversed experts, whose F is several
    times H), the output [N, H]: the same product, since fc2 is linear.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, *,
                 probs_on_output: bool = False):
        super().__init__(config=config)
        refusal = grouped_gemm_refusal(config)
        assert refusal is None, refusal  # RoutedExperts builds the loop instead
        self.num_local_experts = num_local_experts
        self.probs_on_output = probs_on_output
        self.defer_wgrad = False  # moe_variants.common.wgrad.defer_expert_wgrad switches it
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.input_size = config.moe_latent_size or config.hidden_size
        ffn = config.moe_ffn_hidden_size
        glu = 2 if config.gated_linear_unit else 1
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        shapes = {"fc1_weight": (ffn * glu // tp_size, self.input_size),
                  "fc2_weight": (self.input_size, ffn // tp_size)}
        for name, shape in shapes.items():
            param = torch.nn.Parameter(torch.empty(num_local_experts, *shape, dtype=config.params_dtype,
                                                   device=device))
            partition_dim, stride = (1, glu) if name == "fc1_weight" else (2, 1)
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=partition_dim, stride=stride)
            param.allreduce = not config.expert_model_parallel_size > 1  # megatron-core's expert marker
            setattr(self, name, param)
        if config.perform_initialization:
            self._initialize(ffn * glu, ffn, glu, tp_rank, tp_size)
        checkpoint_layout.install(self)  # SequentialMLP's state-dict keys

    @torch.no_grad()
    def _initialize(self, fc1_out: int, ffn: int, glu: int, tp_rank: int, tp_size: int) -> None:
        """``SequentialMLP``'s initialisation: expert by expert, fc1 then fc2, each the TP slice of
        a full matrix drawn on the CPU (``use_cpu_initialization``, megatron-core's
        ``_initialize_affine_weight_cpu``: fc1 split with stride 2 under SwiGLU so each rank holds
        its gate and up halves) or drawn in place on the GPU from the expert-parallel RNG stream."""
        config = self.config
        if not config.use_cpu_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for e in range(self.num_local_experts):
                    config.init_method(self.fc1_weight[e])
                    config.output_layer_init_method(self.fc2_weight[e])
            return
        for e in range(self.num_local_experts):
            for weight, rows, cols, dim, stride, init in (
                (self.fc1_weight, fc1_out, self.input_size, 0, glu, config.init_method),
                (self.fc2_weight, self.input_size, ffn, 1, 1, config.output_layer_init_method),
            ):
                master = torch.empty(rows, cols, dtype=torch.float)
                init(master)
                master = master.to(config.params_dtype)
                parts = torch.split(master, master.shape[dim] // (tp_size * stride), dim=dim)
                weight[e].copy_(torch.cat(parts[tp_rank::tp_size], dim=dim))

    def _activation(self, h: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
        """megatron-core ``MLP``'s activation (its fused SwiGLU where ``bias_activation_fusion``),
        times ``probs`` when given, in ``h``'s dtype."""
        config = self.config
        if config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu:
            if probs is None:
                return bias_swiglu_impl(h, None, config.activation_func_fp8_input_store)
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
            out = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            out = config.activation_func(h)
        if probs is None:
            return out
        return (out * probs.unsqueeze(-1)).to(out.dtype)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        offs = group_offsets(tokens_per_expert, permuted_local_hidden_states.device)
        hidden = grouped_linear(permuted_local_hidden_states, self.fc1_weight, offs, self)  # [N, glu * F]
        hidden = self._activation(hidden, None if self.probs_on_output else permuted_probs)
        output = grouped_linear(hidden, self.fc2_weight, offs, self)  # [N, H]
        if self.probs_on_output:
            output = (output * permuted_probs.unsqueeze(-1)).to(output.dtype)
        return output, None

    def backward_dw(self):
        """megatron-core's split-backward hook (``MoELayer.backward_dw``): the weight gradients are
        computed in the backward, or deferred through ``wgrad``."""

    def expert_weights(self) -> list:
        """``(name, stacked parameter, expert)`` of every per-expert weight, ``name`` being
        ``SequentialMLP``'s state-dict name relative to this module."""
        return [(f"local_experts.{e}.{linear}.weight", getattr(self, name), e)
                for e in range(self.num_local_experts) for name, linear in checkpoint_layout.LINEARS]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``SequentialMLP``'s dist-checkpoint keys and global shapes (the layout's adapter)."""
        return checkpoint_layout.sharded_state_dict(self, prefix, sharded_offsets, metadata)


class RoutedExperts:
    """Spec factory for an MoE layer's routed experts: ``GroupedExperts`` when ``grouped`` and the
    kernel runs (``grouped_gemm_refusal``), else ``loop_module`` (``SequentialMLP`` or a subclass,
    with the spec's submodules), which carries the reason as ``expert_path_reason`` (``describe``).
    """

    def __new__(cls, num_local_experts, config, submodules=None, pg_collection=None, *, grouped: bool = True,
                probs_on_output: bool = False, loop_module=SequentialMLP):
        reason = "--no-moe-grouped-gemm" if not grouped else grouped_gemm_refusal(config)
        if reason is None:
            return GroupedExperts(num_local_experts, config, submodules, pg_collection,
                                  probs_on_output=probs_on_output)
        module = loop_module(num_local_experts, config, submodules, pg_collection=pg_collection)
        module.expert_path_reason = reason
        return module


def local_expert_weights(experts, *, grad: bool = False) -> list:
    """``[(fc1 [glu*F/tp, H], fc2 [H, F/tp])]`` per local expert of a ``GroupedExperts`` (views of the
    stacked parameters) or ``SequentialMLP`` module; with ``grad``, their ``.grad`` instead."""
    if isinstance(experts, GroupedExperts):
        fc1, fc2 = experts.fc1_weight, experts.fc2_weight
        if grad:
            fc1, fc2 = fc1.grad, fc2.grad
        return list(zip(fc1.unbind(0), fc2.unbind(0)))
    pairs = [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    return [(a.grad, b.grad) for a, b in pairs] if grad else pairs


def describe(model) -> Optional[str]:
    """One line naming how ``model``'s MoE layers compute their routed experts and why, e.g.
    ``grouped GEMM (torch grouped_mm, torch.bfloat16 on cuda)`` or ``SequentialMLP loop
    (--no-moe-grouped-gemm)``; None without routed experts."""
    seen = []
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            param = module.fc1_weight
            line = f"{GROUPED} (torch grouped_mm, {param.dtype} on {param.device.type})"
        elif isinstance(module, SequentialMLP):
            reason = getattr(module, "expert_path_reason", None)
            line = f"{LOOP} ({reason})" if reason else LOOP
        elif type(module).__name__ == "TEGroupedMLP":
            line = "TEGroupedMLP (Transformer Engine)"
        else:
            continue
        if line not in seen:
            seen.append(line)
    return "; ".join(seen) or None
