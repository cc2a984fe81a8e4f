"""FarSkip-Collective transformer layer (paper §3, §4.1) on megatron-core's ``TransformerLayer``.

A FarSkip MoE layer k, given A_{k-1} (attention stream) and o_{k-1} (full stream):

    attn-in_k  = A_{k-1}                       (``attn-only``/``full``; o_{k-1} for ``mlp-only``)
    residual_k = o_{k-1} + attn_k(LN1(attn-in_k))
    mlp-in_k   = o_{k-1}                       (``mlp-only``/``full``; residual_k for ``attn-only``)
    routed_k, shared_k = MoE(LN2(mlp-in_k))
    A_k = residual_k + shared_k
    o_k = A_k + routed_k

Dense layers inside a FarSkip range run their MLP in parallel on the same input and collapse the
two streams (A_k = o_k). With ``reference`` connectivity the standard MoE layer right before a range
(its *lead-in*, ``farskip_lead_in``) runs the standard connectivity (attention and MoE on the full
stream, the MoE after attention) but still hands on both streams, A_k = residual_k + shared_k and
o_k = A_k + routed_k, so the range's first attention reads A_k as the authors' implementation does.
The layer has exactly ``TransformerLayer``'s parameters: FarSkip changes the forward only, so any
checkpoint loads with either connectivity.

Two executions of the same math, with the same additions in the same order (so the forward is
bit-identical):

- **simple**: blocking collectives, o_k completed inside the layer (reference, fine-tuning);
- **overlapped**: (1) QKV of attention on A_{k-1}, and core attention of the first half of the
  micro-batch, while layer k-1's combine is in flight; (2) wait it, o_{k-1} = A_{k-1} +
  routed_{k-1}; (3) route and *start* the dispatch; (4) core attention of the second half and the
  output projection while the dispatch flies; (5) wait, routed experts, *start* the combine; (6) the
  shared expert while the combine flies; hand A_k and the pending combine to layer k+1. Backward
  all-to-alls are asynchronous too (``moe_variants.common.comm``); autograd sequence numbers order
  the backward so that the gradient all-to-alls overlap the attention and shared-expert backward.
  Self-attention and multi-latent attention are split (``attention.py``); at inference, where
  attention runs whole over the KV cache, the combine overlaps the next layer's whole attention and
  the dispatch the shared expert (``_inference_forward``; with ``inference_heads`` half of a prefill's
  core attention moves behind the dispatch).

KV-cached generation (megatron-core's static and dynamic engines) runs through the same layer:
the block unwraps the inference-mode input and attention reads and writes the cache; the tokens
equal a full recompute (tests/eval/test_lm_eval_adapter.py, tests/serving/test_variants.py).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.compat.split_attention import HeadSplit
from moe_variants.common.comm import set_backward_priority
from moe_variants.farskip.attention import (
    attention_out,
    attention_proj,
    attention_qkv,
    can_split,
    core_attention_rows,
    input_projections,
    project_inputs,
    projected_inputs,
)
from moe_variants.farskip.config import FarSkipMode
from moe_variants.farskip.connectivity import FarSkipState, PendingRouted
from moe_variants.common.tp import PendingReduction, unreduced

__all__ = ["FarSkipTransformerLayer"]

# Backward priorities inside a layer (see comm.LAUNCH_BACKWARD / DEFER_BACKWARD for the ends of
# the scale; nodes keep their large default numbers otherwise). The paper's Fig. 10 order: after
# the combine's gradient all-to-all is launched, the shared-expert backward and the attention
# backward down to the QKV outputs (residual add, output projection, core attention: default
# numbers) overlap it; then the expert backward (COMBINE_INPUT, whose hook waits); then, while the
# dispatch's gradient all-to-all flies, the QKV projection (QKV); last the dispatch input's
# producer (DEFER_BACKWARD), whose hook waits. The attention's backward is thus split over the two
# gradient all-to-alls of the layer.
COMBINE_INPUT = 3
QKV = 2


log = logging.getLogger(__name__)
_warned_split: list = []  # warn once per process


def _noop():
    pass


class FarSkipTransformerLayer(TransformerLayer):
    """``TransformerLayer`` with FarSkip connectivity; call ``farskip_forward``."""

    farskip_lead_in: bool = False  # standard connectivity, two streams out (set by ``apply_farskip``)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_dropout and self.training:
            return F.dropout(x, p=self.hidden_dropout, training=True)
        return x

    @contextlib.contextmanager
    def _phase(self, name: str):
        timeline = None
        if self.is_moe_layer:
            timeline = getattr(self.mlp.token_dispatcher.comm, "timeline", None)
        if timeline is None:
            yield
            return
        start = time.perf_counter()
        yield
        timeline.add(f"{name} L{self.layer_number}", "compute", start, time.perf_counter())

    def _mark_backward(self, tensor: torch.Tensor, name: str) -> None:
        """With a timeline attached, record when ``tensor``'s gradient is computed (an instant on
        the compute lane), to see the backward order."""
        timeline = getattr(self.mlp.token_dispatcher.comm, "timeline", None) if self.is_moe_layer else None
        if timeline is None or not tensor.requires_grad:
            return

        def hook(grad):
            now = time.perf_counter()
            timeline.add(f"{name} L{self.layer_number}", "compute", now, now)
            return grad

        tensor.register_hook(hook)

    def _start_dispatch(self, moe_in, overlapped: bool):
        mlp = self.mlp
        probs, routing_map = mlp.route(moe_in)
        tokens, probs = mlp.preprocess(moe_in, probs, routing_map)
        if overlapped:
            return mlp.token_dispatcher.token_dispatch_async(tokens, probs)
        tokens, probs = mlp.dispatch(tokens, probs)
        return tokens, probs, _noop

    def _experts_and_start_combine(self, dispatched, overlapped: bool):
        tokens, probs, wait = dispatched
        wait()
        expert_out, _ = self.mlp.routed_experts_compute(tokens, probs)
        if overlapped:
            combined, wait_combine = self.mlp.token_dispatcher.token_combine_async(expert_out)
            set_backward_priority(expert_out, COMBINE_INPUT)
            return combined, wait_combine
        return self.mlp.combine(expert_out), _noop

    def _shared_expert(self, moe_in, async_tp: bool):
        """The shared expert on ``moe_in``: ``(output, None)``, or with ``async_tp`` ``(None,
        PendingReduction)`` whose ``wait()`` gives the same output, its TP reduction in flight
        behind the routed experts (not with a shared-expert gate, which scales the reduced sum)."""
        shared_mlp = self.mlp.shared_experts if self.mlp.use_shared_expert else None
        if not async_tp or shared_mlp is None or shared_mlp.use_shared_expert_gate:
            return self.mlp.shared_experts_compute(moe_in), None
        fc2 = shared_mlp.linear_fc2
        with unreduced(fc2):
            partial = self.mlp.shared_experts_compute(moe_in)
        return None, PendingReduction(partial, fc2.tp_group, self.config.sequence_parallel)

    def _inference_forward(self, state: FarSkipState, *, attention_mask, inference_context, attn_kwargs,
                           async_tp: bool = False, split: bool = False, heads: bool = False):
        """The overlapped schedule when attention must run whole (megatron-core's inference path
        over the KV cache, or precomputed rotary cos/sin), for the ``full`` mode of an MoE layer:
        (1) attention on A_{k-1} while layer k-1's combine flies; (2) wait it, o_{k-1}; (3) route
        and *start* the dispatch; (4) the shared expert while it flies; (5) wait, routed experts,
        *start* the combine; hand A_k and the pending combine to layer k+1, whose attention it
        overlaps. The same additions in the same order as ``simple``: the same outputs.

        ``split`` (the paper's training schedule, Fig. 9, at inference): only attention's input
        projections run in (1), behind the previous combine; the rest of attention (core attention
        over the KV cache and the output projection) runs after (3), behind the dispatch
        (``attention.project_inputs``); the shared expert runs after (5), behind this layer's
        combine, which the next layer's input projections then also overlap.

        ``heads`` (the training schedule's halves of core attention, at inference, by heads): a prefill
        step's core attention over the KV cache runs for the first half of its heads in (1), behind the
        previous combine, and for the other half, with the output projection, after (3), behind the
        dispatch, beside the shared expert (``megatron.compat.split_attention``); decode steps run (1)
        whole.

        ``async_tp`` (paper §4.2, TP > 1): the attention projection's tensor-parallel reduction flies
        behind (3)-(5), and the shared expert's behind (5); both are waited only when the residual is
        formed (``tp.py``). With the replicated-activation expert layout (``ReplicatedDispatcher``,
        vLLM's) the dispatch is a no-op and the "combine" is the all-reduce of the experts' partial
        sums, in flight behind the next layer's whole attention: every collective of the layer then
        has a window."""
        attn = self.self_attention

        def run_attention(hidden, projected=None):
            with unreduced(attn.linear_proj) if async_tp else contextlib.nullcontext():
                with projected_inputs(projected) if projected is not None else contextlib.nullcontext():
                    out, bias = attn(hidden, attention_mask=attention_mask, inference_context=inference_context,
                                     **attn_kwargs)
            pending = PendingReduction(out, attn.linear_proj.tp_group, self.config.sequence_parallel) \
                if async_tp else None
            return out, bias, pending

        hidden = self.input_layernorm(state.attn_stream)
        projected = None
        head_split = HeadSplit(attn) if heads else None
        if split and input_projections(attn):
            with self._phase("qkv"):  # (1) only the input projections
                projected = project_inputs(attn, hidden)
        elif head_split is not None:
            with self._phase("attention part 1"), head_split.early():  # (1) a prefill's first heads
                attn_out, attn_bias, reduction = run_attention(hidden)
        else:
            with self._phase("attention"):  # (1)
                attn_out, attn_bias, reduction = run_attention(hidden)
        with self._phase("finish combine"):
            full_prev = state.full_stream()  # (2)
        with self._phase("route"):  # (3)
            moe_in = self.pre_mlp_layernorm(full_prev)
            dispatched = self._start_dispatch(moe_in, overlapped=True)
        if head_split is not None and head_split.deferred:
            with self._phase("attention part 2"):  # (4a) the other heads and the projection behind the dispatch
                attn_out, attn_bias = head_split.finish()
        if projected is not None:
            with self._phase("attention"):  # (4a) the rest of attention behind the dispatch
                attn_out, attn_bias, reduction = run_attention(hidden, projected)
            self.projected_inputs_used = projected.used
            if projected.used != len(projected.outputs) and not _warned_split:
                _warned_split.append(True)
                log.warning("FarSkip split attention: the forward took %d of %d precomputed input projections "
                            "(%s) and recomputed the rest; the split does not save them",
                            projected.used, len(projected.outputs), type(attn).__name__)
        if projected is None:
            with self._phase("shared expert"):  # (4)
                shared, shared_reduction = self._shared_expert(moe_in, async_tp)
        with self._phase("experts"):  # (5)
            combined, wait_combine = self._experts_and_start_combine(dispatched, overlapped=True)
        if projected is not None:
            with self._phase("shared expert"):  # (6) split: behind the combine, as in training (Fig. 9)
                shared, shared_reduction = self._shared_expert(moe_in, async_tp)
        if async_tp:
            with self._phase("finish attention reduction"):
                attn_out = reduction.wait()
                if shared_reduction is not None:
                    shared = shared_reduction.wait()
        residual = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
            (attn_out, attn_bias), full_prev, self.hidden_dropout
        )
        attn_stream = residual if shared is None else residual + self._dropout(shared)
        return FarSkipState(
            attn_stream=attn_stream,
            pending=PendingRouted(self.mlp, combined, wait_combine, attn_stream, self._dropout),
        )

    def farskip_forward(
        self,
        state: FarSkipState,
        *,
        attention_mask,
        rotary_pos_emb=None,
        overlapped: bool,
        mode: FarSkipMode = FarSkipMode.full,
        inference_context=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        sequence_len_offset=None,
        async_tp: bool = False,
        inference_split: bool = False,
        inference_heads: bool = False,
    ) -> FarSkipState:
        """One FarSkip layer; returns the state for the next layer (see the module docstring).

        With an ``inference_context`` (KV-cached generation), or precomputed rotary cos/sin (fused
        or flash-decode RoPE), attention runs whole through megatron-core's own
        ``Attention.forward``: ``overlapped`` then takes ``_inference_forward``'s schedule (the
        ``full`` mode; the other modes and a lead-in layer block).
        """
        attn = self.self_attention
        precomputed_rope = any(t is not None for t in (rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin))
        async_tp = async_tp and self.config.tensor_model_parallel_size > 1
        if async_tp and torch.is_grad_enabled():
            raise ValueError("--farskip-async-tp is for inference (forward only, no gradients)")
        attn_reads_a = mode in (FarSkipMode.full, FarSkipMode.attn_only) and not self.farskip_lead_in
        moe_reads_pre = mode in (FarSkipMode.full, FarSkipMode.mlp_only) and not self.farskip_lead_in
        if overlapped and self.is_moe_layer and attn_reads_a and moe_reads_pre and (
                inference_context is not None or precomputed_rope or async_tp):
            return self._inference_forward(
                state, attention_mask=attention_mask, inference_context=inference_context, async_tp=async_tp,
                split=inference_split, heads=inference_heads and inference_context is not None and not async_tp,
                attn_kwargs=dict(rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                 rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
                                 sequence_len_offset=sequence_len_offset),
            )
        split = can_split(attn) and inference_context is None and not precomputed_rope
        overlapped = overlapped and inference_context is None

        qkv = None
        early_core = None  # core attention of the first half of the micro-batch
        if split and attn_reads_a:  # (1) overlaps the previous layer's combine
            with self._phase("qkv"):
                qkv = attention_qkv(attn, self.input_layernorm(state.attn_stream), rotary_pos_emb)
            half = qkv[0].size(1) // 2
            if overlapped and self.is_moe_layer and half > 0:  # (1b) and so does half the core attention
                with self._phase("attention part 1"):
                    early_core = core_attention_rows(attn, *qkv, attention_mask, 0, half)
        with self._phase("finish combine"):
            full_prev = state.full_stream()  # (2) o_{k-1}
        attn_in = state.attn_stream if attn_reads_a else full_prev
        if split and qkv is None:
            with self._phase("qkv"):
                qkv = attention_qkv(attn, self.input_layernorm(attn_in), rotary_pos_emb)

        dispatched = moe_in = None
        if self.is_moe_layer and moe_reads_pre:  # (3) dispatch overlaps the rest of attention
            with self._phase("route"):
                moe_in = self.pre_mlp_layernorm(full_prev)
                dispatched = self._start_dispatch(moe_in, overlapped)

        with self._phase("attention"):  # (4)
            if early_core is not None:
                late_core = core_attention_rows(attn, *qkv, attention_mask, early_core.size(1), qkv[0].size(1))
                attn_out = attention_proj(attn, [early_core, late_core])
            elif split:
                attn_out = attention_out(attn, *qkv, attention_mask)
            else:
                attn_out = attn(
                    self.input_layernorm(attn_in), attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
                    inference_context=inference_context, sequence_len_offset=sequence_len_offset,
                )
            residual = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attn_out, full_prev, self.hidden_dropout
            )
        if overlapped and split:
            for t in qkv:
                set_backward_priority(t, QKV)
            if early_core is not None:  # the second half's core attention backward joins QKV's window
                set_backward_priority(late_core, QKV)
            self._mark_backward(qkv[0], "qkv bwd")
            self._mark_backward(attn_out[0] if isinstance(attn_out, tuple) else attn_out, "attention bwd")

        if not self.is_moe_layer:  # dense: parallel MLP, streams collapse
            with self._phase("mlp"):
                mlp_in = self.pre_mlp_layernorm(full_prev if moe_reads_pre else residual)
                out = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                    self.mlp(mlp_in), residual, self.hidden_dropout
                )
            return FarSkipState.single(out)

        if dispatched is None:  # attn-only: the MoE reads the post-attention residual
            with self._phase("route"):
                moe_in = self.pre_mlp_layernorm(residual)
                dispatched = self._start_dispatch(moe_in, overlapped)
        with self._phase("experts"):  # (5)
            combined, wait_combine = self._experts_and_start_combine(dispatched, overlapped)
        with self._phase("shared expert"):  # (6) overlaps the combine
            shared = self.mlp.shared_experts_compute(moe_in)
            attn_stream = residual if shared is None else residual + self._dropout(shared)
        state = FarSkipState(
            attn_stream=attn_stream,
            pending=PendingRouted(self.mlp, combined, wait_combine, attn_stream, self._dropout),
        )
        if not overlapped:
            state.full_stream()
        return state
