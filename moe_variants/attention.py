"""Core attention on torch's ``scaled_dot_product_attention`` (SDPA) for the local spec.

megatron-core 0.16.1's local spec attends with ``DotProductAttention``: the full [b, heads, s, s]
score matrix, a softmax, then a second matmul. ``SDPAttention`` takes the same constructor and
forward (``DotProductAttention``'s, plus MLA's ``k_channels``/``v_channels``) and no parameters
of its own, so checkpoints load either way; it calls SDPA with the backends that
``--attention-backend`` names (``config.AttentionBackend``), as torchtitan's core attention does:

==========  ===========================================================================
``auto``    CUDA sm90 and newer: cuDNN, FlashAttention, memory-efficient (torchtitan's
            order); other GPUs: FlashAttention, memory-efficient, cuDNN; CPU: FlashAttention
``flash``   FlashAttention (torch's FA2 on CUDA; its CPU flash kernel on CPU)
``fused``   cuDNN, then memory-efficient (Transformer Engine's "fused" attention is cuDNN's)
``unfused`` torch's math reference (scores materialised, like TE's unfused attention)
``local``   megatron-core's ``DotProductAttention`` itself (not this module)
==========  ===========================================================================

Every list ends with the math kernel, which runs where no fused kernel takes the inputs (e.g.
attention dropout on the CPU flash kernel); ``describe`` names the kernel a model's attention runs.

What it supports, like ``DotProductAttention``: causal self-attention (megatron-core's bool masks,
True = masked: the causal mask ``builder.causal_attention_mask`` makes is recognised as causal
without reading it, any other mask is applied as given), grouped-query attention (``enable_gqa``),
MLA's query/key heads wider than its value heads (values zero-padded to the key width where the
first kernel of the order needs equal widths, the output sliced back), attention dropout (under
megatron-core's model-parallel RNG tracker, as the reference) and the softmax scale (including
``apply_query_key_layer_scaling``, whose scale and coefficient cancel). A fully masked query row
comes out as zeros or NaN depending on the kernel, where the reference's -10000 fill gives a
uniform average; the project's masks never have one. Packed sequences (``packed_seq_params``),
attention biases, sliding windows and non-vanilla softmax are refused, as by the reference or
with a pointer to ``--attention-backend local``.

Shape legend: ``S`` query positions, ``K`` key positions, ``B`` micro-batch, ``Hq``/``Hk`` query /
key-value heads, ``D`` query/key head dim, ``Dv`` value head dim.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.compat.sdpa import sdpa_kernel_choice
from moe_variants.config import AttentionBackend

__all__ = ["SDPAttention", "sdpa_attention_class", "sdpa_backends", "mark_causal", "is_marked_causal",
           "describe", "KERNEL_NAMES"]

KERNEL_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
}

# id -> weak reference of the causal masks recorded by mark_causal (by identity: a tensor's == is
# elementwise, so tensors cannot sit in a WeakSet)
_CAUSAL_MASKS: dict = {}


def mark_causal(mask: torch.Tensor) -> torch.Tensor:
    """Record ``mask`` (a [1, 1, S, S] bool causal mask) as causal, so that ``SDPAttention`` runs
    SDPA's causal kernels instead of reading it; returns the mask."""
    key = id(mask)
    _CAUSAL_MASKS[key] = weakref.ref(mask, lambda _, key=key: _CAUSAL_MASKS.pop(key, None))
    return mask


def is_marked_causal(mask: Optional[torch.Tensor]) -> bool:
    """Whether ``mask`` is a causal mask recorded by ``mark_causal`` (and still alive)."""
    ref = _CAUSAL_MASKS.get(id(mask)) if mask is not None else None
    return ref is not None and ref() is mask


def sdpa_backends(backend: AttentionBackend, device: torch.device) -> list:
    """The SDPA backends ``backend`` enables on ``device``, in priority order (math last)."""
    cuda = device.type == "cuda"
    if backend == AttentionBackend.auto:
        if not cuda:
            order = [SDPBackend.FLASH_ATTENTION]
        elif torch.cuda.get_device_capability(device)[0] >= 9:
            order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        else:
            order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    elif backend == AttentionBackend.flash:
        order = [SDPBackend.FLASH_ATTENTION]
    elif backend == AttentionBackend.fused:
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if cuda else []
    elif backend == AttentionBackend.unfused:
        order = []
    else:
        raise ValueError(f"--attention-backend {backend} does not run on torch's scaled_dot_product_attention")
    return order + [SDPBackend.MATH]


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` on ``torch.nn.functional.scaled_dot_product_attention`` (see the
    module docstring). ``backend`` is set by ``sdpa_attention_class``."""

    backend: AttentionBackend = AttentionBackend.auto

    def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax type {config.softmax_type!r} needs --attention-backend local")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            raise ValueError("sliding-window attention needs --attention-backend local")
        self.key_channels = k_channels or self.hidden_size_per_attention_head
        if v_channels is not None:  # MLA: value heads narrower than query/key heads
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        # DotProductAttention divides its scale by the layer number under query-key layer scaling
        # and multiplies the scores back inside its softmax: the product is the plain scale
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)
        self.kernel: Optional[str] = None  # the kernel the last forward ran

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [S, B, Hq, D], key [K, B, Hk, D], value [K, B, Hk, Dv] -> [S, B, Hq * Dv]."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences (packed_seq_params) are not supported by the local spec's "
                             "attention; use Transformer Engine")
        if attention_bias is not None:
            raise ValueError("attention bias is not supported by the local spec's attention")
        q_BHSD, k_BHKD, v_BHKD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask, causal = self.sdpa_mask(attention_mask, q_BHSD.size(2), k_BHKD.size(2), q_BHSD.device)
        num_v = v_BHKD.size(-1)
        dropout = self.attention_dropout.p if self.training else 0.0
        args = dict(attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.sdpa_scale,
                    enable_gqa=q_BHSD.size(1) != k_BHKD.size(1))
        backends = sdpa_backends(self.backend, q_BHSD.device)
        with sdpa_kernel(backends, set_priority=True):
            if num_v != k_BHKD.size(-1) and self.pad_values(backends[0]):
                v_BHKD = F.pad(v_BHKD, (0, k_BHKD.size(-1) - num_v))
            if self.kernel is None:
                self.kernel = KERNEL_NAMES.get(sdpa_kernel_choice(q_BHSD, k_BHKD, v_BHKD, **args), "other")
            if dropout and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    out_BHSD = F.scaled_dot_product_attention(q_BHSD, k_BHKD, v_BHKD, **args)
            else:
                out_BHSD = F.scaled_dot_product_attention(q_BHSD, k_BHKD, v_BHKD, **args)
        out_SBHD = out_BHSD[..., :num_v].permute(2, 0, 1, 3)
        return out_SBHD.reshape(out_SBHD.size(0), out_SBHD.size(1), -1)

    def sdpa_mask(self, attention_mask, num_q: int, num_k: int, device):
        """(SDPA's ``attn_mask`` (bool, True = attend) or None, ``is_causal``) for megatron-core's
        ``attention_mask`` (bool, True = masked) under this layer's mask type, as the reference
        applies it: no mask and a causal layer -> causal (none for a single query, a decode step);
        a recorded causal mask of this square shape -> causal; any other mask as given."""
        if attention_mask is None:
            if self.attn_mask_type != AttnMaskType.causal or num_q == 1:
                return None, False
            if num_q == num_k:
                return None, True
            # queries at the end of the keys (bottom-right aligned): SDPA's is_causal is top-left
            rows = torch.arange(num_q, device=device)[:, None] + (num_k - num_q)
            return rows >= torch.arange(num_k, device=device)[None, :], False
        if num_q == num_k and is_marked_causal(attention_mask) and attention_mask.shape[-2:] == (num_q, num_k):
            return None, True
        return ~attention_mask, False

    @staticmethod
    def pad_values(first: SDPBackend) -> bool:
        """Whether values narrower than the keys are zero-padded: FlashAttention needs equal widths
        (cuDNN and the others take MLA's unequal ones)."""
        return first == SDPBackend.FLASH_ATTENTION

    def expected_kernel(self, num_tokens: int = 128) -> str:
        """The kernel a training forward of causal self-attention would run on this machine (SDPA's
        own choice on small inputs of this layer's heads, widths, dtype and dropout)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dtype = self.config.params_dtype
        num_heads, num_groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        q = torch.zeros(1, num_heads, num_tokens, self.key_channels, device=device, dtype=dtype)
        k = torch.zeros(1, num_groups, num_tokens, self.key_channels, device=device, dtype=dtype)
        backends = sdpa_backends(self.backend, device)
        num_v = self.hidden_size_per_attention_head
        if num_v != self.key_channels and not self.pad_values(backends[0]):
            v = torch.zeros(1, num_groups, num_tokens, num_v, device=device, dtype=dtype)
        else:
            v = k
        with sdpa_kernel(backends, set_priority=True):
            choice = sdpa_kernel_choice(q, k, v, dropout_p=self.attention_dropout.p, is_causal=True,
                                        scale=self.sdpa_scale, enable_gqa=num_heads != num_groups)
        return KERNEL_NAMES.get(choice, "other")


@functools.lru_cache(maxsize=None)
def sdpa_attention_class(backend: AttentionBackend) -> type:
    """The ``SDPAttention`` subclass for ``backend`` (megatron-core builds core attention from a
    class, with no way to pass it more arguments)."""
    return type(f"SDPAttention_{backend.value}", (SDPAttention,), {"backend": backend, "__doc__": SDPAttention.__doc__})


def describe(model) -> Optional[str]:
    """One line naming ``model``'s core attention and the kernel it runs (its last forward's, or
    before any the one SDPA picks for a training forward), e.g. ``torch scaled_dot_product_attention,
    flash kernel (--attention-backend auto)``; None without attention layers."""
    seen = []
    for module in model.modules():
        if isinstance(module, SDPAttention):
            line = (f"torch scaled_dot_product_attention, {module.kernel or module.expected_kernel()} kernel "
                    f"(--attention-backend {module.backend})")
        elif isinstance(module, DotProductAttention):
            line = "megatron-core DotProductAttention (--attention-backend local)"
        elif type(module).__name__ == "TEDotProductAttention":
            line = "Transformer Engine DotProductAttention"
        else:
            continue
        if line not in seen:
            seen.append(line)
    return "; ".join(seen) or None
