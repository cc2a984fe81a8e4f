"""FarSkip transformer block: threads the two residual streams through the layers.

megatron-core's ``TransformerBlock.forward`` passes one tensor between layers
(``transformer_block.py:748-786``); this subclass passes a ``FarSkipState`` through FarSkip layers,
collapses it to the full stream before a standard layer, and waits for the last pending combine
before the final norm (so nothing is in flight when a pipeline stage hands its output on). With
an inference context (KV-cached generation, megatron-core's static or dynamic engine) the input
arrives as megatron-core's ``WrappedTensor`` and is unwrapped as ``TransformerBlock`` does; the
layers then run attention through upstream's ``Attention.forward`` with that context.

``apply_farskip`` converts a built ``GPTModel`` in place: the block and the selected layers change
class, no parameter changes, so any checkpoint loads with either connectivity. With ``reference``
connectivity the standard MoE layer right before the range (``FarSkipConfig.lead_in_layer``) also
becomes a ``FarSkipTransformerLayer``, with standard connectivity but handing the range both streams.
"""

from __future__ import annotations

from contextlib import nullcontext

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from moe_variants.common.wgrad import defer_expert_wgrad, defer_wgrad
from moe_variants.farskip.config import FarSkipConfig, FarSkipMode
from moe_variants.farskip.connectivity import FarSkipState
from moe_variants.farskip.layer import FarSkipTransformerLayer

__all__ = ["FarSkipTransformerBlock", "apply_farskip", "check_farskip_supported"]


class FarSkipTransformerBlock(TransformerBlock):
    """``TransformerBlock`` whose FarSkip layers exchange two residual streams."""

    farskip_overlapped: bool = False
    farskip_mode: FarSkipMode = FarSkipMode.full
    farskip_async_tp: bool = False
    farskip_inference_split: bool = False
    farskip_inference_heads: bool = False
    # when a list, each layer's full output stream is appended (FCSD's hidden-state L2); this
    # completes every combine inside its own layer, so it removes the cross-layer overlap
    layer_output_sink = None

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, padding_mask=None, *,
                inference_params=None, dynamic_inference_decode_only=None):
        """``TransformerBlock.forward`` (``transformer_block.py:621-800``, without recompute, FP8/FP4
        and CPU offloading, which ``check_farskip_supported`` refuses) threading a ``FarSkipState``
        through the FarSkip layers. With no FarSkip layer it is bit-identical to the upstream
        forward (tests/farskip/test_block_copy.py)."""
        inference_context = inference_context or inference_params
        if context is not None or packed_seq_params is not None or attention_bias is not None:
            raise ValueError("FarSkip layers support neither cross-attention, packed sequences "
                             "nor an attention bias")
        # GPTModel hands an inference-mode decoder its input wrapped (gpt_model.py:432), as
        # TransformerBlock.forward expects (transformer_block.py:682-683)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        rotary = dict(rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                      rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin)
        with rng:
            state = FarSkipState.single(hidden_states)
            for layer in self.layers:
                if isinstance(layer, FarSkipTransformerLayer):
                    state = layer.farskip_forward(
                        state, attention_mask=attention_mask, overlapped=self.farskip_overlapped,
                        mode=self.farskip_mode, inference_context=inference_context,
                        async_tp=self.farskip_async_tp, inference_split=self.farskip_inference_split,
                        inference_heads=self.farskip_inference_heads,
                        sequence_len_offset=sequence_len_offset, **rotary,
                    )
                else:
                    hidden, _ = layer(
                        hidden_states=state.full_stream(), attention_mask=attention_mask,
                        context=None, context_mask=None, attention_bias=None,
                        inference_context=inference_context, packed_seq_params=None,
                        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, **rotary,
                    )
                    state = FarSkipState.single(hidden)
                if self.layer_output_sink is not None:
                    self.layer_output_sink.append(state.full_stream())
            hidden_states = state.full_stream()  # the last combine must land before the norm
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()
        return hidden_states


def check_farskip_supported(config, farskip_layers, pipeline_size: int, num_layers: int,
                            lead_in=None) -> None:
    """Refuse what FarSkip cannot run correctly on this megatron-core ``TransformerConfig``, with a
    one-line ``ValueError`` (settings of our own configs are checked by the variant's ``validate``).
    ``lead_in``: the standard layer that hands the range two streams (``reference``), or None."""
    if config.recompute_granularity is not None:
        raise ValueError("--farskip cannot be combined with activation recompute: re-running a "
                         "layer's forward would issue its collectives twice")
    if config.cuda_graph_impl != "none":
        raise ValueError("--farskip cannot be combined with CUDA graphs (collectives in flight "
                         "across layers)")
    if config.overlap_moe_expert_parallel_comm:
        raise ValueError("--farskip cannot be combined with --overlap-moe-expert-parallel-comm: "
                         "both schedule the same dispatch/combine phases")
    if config.fp8 or getattr(config, "fp4", None):
        raise ValueError("--farskip is not implemented with FP8/FP4 training")
    if config.cpu_offloading:
        raise ValueError("--farskip cannot be combined with activation CPU offloading")
    if pipeline_size > 1:
        per_stage = num_layers // pipeline_size
        for first in range(per_stage, num_layers, per_stage):
            if first in farskip_layers and (first - 1 in farskip_layers or first - 1 == lead_in):
                what = "a FarSkip layer" if first - 1 in farskip_layers else "the MoE layer that hands it two streams"
                raise ValueError(
                    f"--farskip: layer {first} starts a pipeline stage but its predecessor is "
                    f"{what} on another stage (only one residual stream crosses a stage); "
                    f"exclude layer {first}, use --farskip-connectivity paper-text, or use "
                    f"--pipeline-model-parallel-size 1"
                )


def apply_farskip(gpt, cfg: FarSkipConfig, moe_pattern: list):
    """Switch a built ``GPTModel``'s selected layers (``cfg.farskip``) to FarSkip connectivity.
    ``moe_pattern``: 1 for an MoE layer, 0 for a dense one, per layer of the whole model."""
    num_layers = len(moe_pattern)
    selected = cfg.layers(num_layers)
    if not selected:
        return gpt
    lead_in = cfg.lead_in_layer(moe_pattern)
    block = gpt.decoder
    check_farskip_supported(block.config, selected, block.config.pipeline_model_parallel_size, num_layers, lead_in)
    if type(block) is not TransformerBlock:
        raise ValueError(f"--farskip needs megatron-core's TransformerBlock, got {type(block).__name__}")
    block.__class__ = FarSkipTransformerBlock
    block.farskip_overlapped = cfg.overlapped
    block.farskip_mode = cfg.farskip_mode
    block.farskip_async_tp = cfg.farskip_async_tp
    block.farskip_inference_split = cfg.farskip_inference_split
    block.farskip_inference_heads = cfg.farskip_inference_heads
    for layer in block.layers:
        index = layer.layer_number - 1
        if index in selected or index == lead_in:
            if type(layer) is not TransformerLayer:
                raise ValueError(f"--farskip needs megatron-core's TransformerLayer, got {type(layer).__name__}")
            layer.__class__ = FarSkipTransformerLayer
            layer.farskip_lead_in = index == lead_in
            if block.farskip_overlapped and cfg.farskip_defer_wgrad and layer.is_moe_layer:
                defer_expert_wgrad(layer.mlp)
    if block.farskip_overlapped and cfg.farskip_defer_wgrad:
        defer_wgrad(getattr(gpt, "output_layer", None))  # only the last pipeline stage has one
    return gpt
