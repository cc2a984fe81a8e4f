"""megatron-core's dynamic inference engine over one of this project's checkpoints, on one rank.

``build_engine`` assembles the upstream pieces as Megatron-LM's own server does: the model from
``loading.load_model`` (any variant, at the requested TP/EP layout), megatron-core's
``GPTInferenceWrapper``, its ``DynamicInferenceContext`` (paged KV cache, continuous batching,
chunked prefill), a ``TextGenerationController`` and the ``DynamicInferenceEngine``. On CPU the
engine runs through ``megatron.compat.inference`` (plain-torch paged attention, no NVTX).

Two things are ours, in ``ServingController`` (a subclass of the upstream controller):

- sampling never picks a padded-vocabulary id: the output layer has ``padded_vocab_size`` columns
  (a multiple of 128 x TP) but only the tokenizer's ids are tokens, so their logits are set to
  ``-inf`` before sampling; greedy decoding then equals ``argmax`` over the tokenizer's vocabulary,
  which is what ``lm_eval_adapter``'s generation takes;
- a request may carry its own ``seed`` (OpenAI's ``seed``): it is then sampled with its own
  ``torch.Generator``, so its tokens do not depend on which other requests share its steps.

``RankEngine`` wraps the engine for the serving loop: add and cancel requests, step, run the
dummy forward of an idle expert-parallel rank, and report per-request token deltas and the
rank's KV-cache, all-to-all and local-activation counters (Sem-MoE's LAR: the (token, routed
expert) pairs of real tokens whose expert sits on this rank, counted from the routers' top-k;
padding and dummy forwards are not counted).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch

__all__ = ["EngineConfig", "RankEngine", "TokenUpdate", "build_engine"]


@dataclasses.dataclass
class EngineConfig:
    """Sizes of the engine on one rank (validated by ``validate``)."""

    max_batch_tokens: int = 512  # tokens in one forward (prefill chunks are cut to fit)
    max_requests: int = 16  # requests decoding at once
    kv_cache_gb: float = 0.25  # paged KV-cache buffer per rank
    block_size_tokens: Optional[int] = None  # None: 256 with flash-attn kernels, else 32
    max_sequence_length: Optional[int] = None  # prompt + output; None: the checkpoint's seq_length
    seed: int = 1234

    def validate(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.max_batch_tokens < self.max_requests:
            raise ValueError(f"--max-batch-tokens ({self.max_batch_tokens}) must be >= --max-requests "
                             f"({self.max_requests}): a decode step feeds one token per request")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.block_size_tokens is not None and self.block_size_tokens < 1:
            raise ValueError(f"--block-size-tokens must be >= 1, got {self.block_size_tokens}")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise ValueError(f"--max-sequence-length must be >= 2, got {self.max_sequence_length}")


def _controller_class():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class ServingController(TextGenerationController):
        """``TextGenerationController`` with the tokenizer's vocabulary and per-request seeds
        (see the module docstring)."""

        def __init__(self, inference_wrapped_model, tokenizer, *, vocab_size: int, pp_group=None):
            super().__init__(inference_wrapped_model, tokenizer, pp_group)
            self.vocab_size = int(vocab_size)
            self.request_generators: dict[int, torch.Generator] = {}

        def _dynamic_step_sample_logits(self, logits):
            if logits.shape[-1] > self.vocab_size:
                logits[..., self.vocab_size:] = float("-inf")
            context = self.inference_wrapped_model.inference_context
            active = slice(context.paused_request_count, context.total_request_count)
            ids = context.request_ids[active].tolist()
            seeded = {i for i, rid in enumerate(ids) if rid in self.request_generators}
            if not seeded:
                return super()._dynamic_step_sample_logits(logits)
            if context.materialize_only_last_token_logits:
                last_BV = logits.squeeze(0)
            else:
                last_BV = context.last_token_logits(logits)
            tokens, indices = [], []
            for bucket, temp, top_k, top_p in self._torch_sampling_buckets:
                plain = [i for i in bucket if i not in seeded]
                if plain:
                    tokens.append(self._torch_sampling_func(last_BV[plain, :], temp, top_k, top_p))
                    indices.append(torch.tensor(plain))
                for i in bucket:
                    if i in seeded:
                        shared, self.sampling_rng = self.sampling_rng, self.request_generators[ids[i]]
                        try:
                            tokens.append(self._torch_sampling_func(last_BV[[i], :], temp, top_k, top_p))
                        finally:
                            self.sampling_rng = shared
                        indices.append(torch.tensor([i]))
            self._sampled_tokens_cuda[torch.cat(indices)] = torch.cat(tokens)

    return ServingController


def __getattr__(name):  # ServingController is built lazily: megatron-core imports are heavy
    if name == "ServingController":
        return _controller_class()
    raise AttributeError(name)


class _TokenizerForEngine:
    """The checkpoint tokenizer with the attributes megatron-core's controller reads (``bos``:
    ``text_generation_controller.py:137``). Prompts reach the engine as token ids."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.bos = getattr(tokenizer, "bos", None)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@dataclasses.dataclass
class TokenUpdate:
    """New tokens of one request since the last report (a rank -> the frontend)."""

    request_id: int
    tokens: list
    finished: bool = False
    failed: Optional[str] = None


def build_engine(model, configs, tokenizer, pg_collection, cfg: EngineConfig):
    """The upstream engine for ``model`` (built by ``loading.load_model``); returns
    ``(engine, controller, context)``."""
    from megatron.compat.inference import apply_inference
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )

    cfg.validate()
    applied = apply_inference()
    config = model.config
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("serving multi-latent attention (DeepSeek-V2 family) is not supported: the dynamic "
                         "engine decodes MLA with FlashMLA, which has no CPU equivalent here")
    if pg_collection.pp.size() != 1:
        raise ValueError("--pipeline-model-parallel-size must be 1 for serving")
    seq_length = cfg.max_sequence_length or configs.model.seq_length
    max_positions = configs.model.max_position_embeddings or configs.model.seq_length
    if configs.model.position_embedding_type == "learned_absolute" and seq_length > max_positions:
        raise ValueError(f"--max-sequence-length {seq_length} exceeds the model's {max_positions} "
                         "learned positions")
    block = cfg.block_size_tokens or (256 if applied["attention_kernels"] == "flash-attn" else 32)
    dtype = config.params_dtype
    padded_vocab = model.output_layer.weight.shape[0] * pg_collection.tp.size() \
        if getattr(model, "output_layer", None) is not None and model.output_layer.weight is not None \
        else model.embedding.word_embeddings.num_embeddings * pg_collection.tp.size()
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size, params_dtype=dtype, inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=padded_vocab, inference_max_requests=cfg.max_requests,
        inference_max_seq_length=seq_length,
    )
    context = DynamicInferenceContext(
        params_dtype=dtype,
        num_layers=config.num_layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups or config.num_attention_heads,
        max_sequence_length=seq_length,
        buffer_size_gb=cfg.kv_cache_gb,
        max_requests=cfg.max_requests,
        max_tokens=cfg.max_batch_tokens,
        block_size_tokens=block,
        pg_collection=pg_collection,
        materialize_only_last_token_logits=True,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
    )
    wrapped = GPTInferenceWrapper(model, wrapper_config, context, pg_collection=pg_collection)
    wrapped.prep_model_for_inference()
    controller = _controller_class()(wrapped, _TokenizerForEngine(tokenizer), vocab_size=tokenizer.vocab_size,
                                     pp_group=pg_collection.pp)
    engine = DynamicInferenceEngine(controller, context, random_seed=int(cfg.seed), pg_collection=pg_collection)
    return engine, controller, context


class RankEngine:
    """One rank's engine as the serving loop drives it (see the module docstring)."""

    def __init__(self, engine, controller, context, model, *, ep_rank: Optional[int] = 0, ep_size: int = 1):
        """``ep_rank`` None: no local-activation counting (defined for attention-DP, TP = 1)."""
        from moe_variants.common.moe_layer import comm_counters, moe_layers

        self.model = model
        self.engine = engine
        self.controller = controller
        self.context = context
        self.counters = comm_counters([model])
        self.sent: dict[int, int] = {}  # request id -> tokens already reported
        self.tokens_forwarded = 0  # real (unpadded) tokens through the model
        self.steps = 0
        self.dummy_steps = 0
        self.busy_s = 0.0  # wall time inside engine steps and dummy forwards
        self.comm = {"a2a_bytes": 0, "a2a_calls": 0, "a2a_time_s": 0.0, "a2a_exposed_s": 0.0}  # harvested
        self.requests_added = 0
        self.activations = None  # LocalActivationCounter when every MoE layer's router reports its top-k
        if ep_rank is not None and moe_layers(model) and all(hasattr(m.router, "routing_observer") for m in moe_layers(model)):
            from moe_variants.common.routing import LocalActivationCounter

            self.activations = LocalActivationCounter(model, ep_rank, ep_size).__enter__()

    # --- requests ---------------------------------------------------------------------------
    def add(self, request_id: int, prompt: list, *, max_tokens: int, temperature: float, top_p: float,
            top_k: int, termination_id: int, seed: Optional[int]) -> None:
        from megatron.core.inference.sampling_params import SamplingParams

        greedy = temperature == 0.0
        params = SamplingParams(
            temperature=1.0 if greedy else float(temperature),
            top_k=1 if greedy else int(top_k),
            top_p=0.0 if greedy or top_k > 0 or top_p >= 1.0 else float(top_p),
            num_tokens_to_generate=int(max_tokens), termination_id=int(termination_id),
        )
        if seed is not None and not greedy:
            self.controller.request_generators[request_id] = torch.Generator().manual_seed(int(seed))
        self.sent[request_id] = 0
        self.requests_added += 1
        self.engine.add_request(request_id, list(prompt), params)

    def cancel(self, request_id: int) -> Optional[TokenUpdate]:
        """Stop a request: a waiting one is dropped at once (its update is returned); an active one
        is finished by the next step through the engine's own early-termination hook (the one its
        stop words use), which releases its KV blocks in ``context.update_requests``."""
        engine = self.engine
        if request_id not in engine.requests:
            return None
        if request_id in engine.waiting_request_ids and request_id != engine.context.chunked_prefill_request_id:
            engine.waiting_request_ids.remove(request_id)
            engine.requests.pop(request_id)
            self._forget(request_id)
            return TokenUpdate(request_id, [], finished=True)
        engine.stop_word_finished_request_ids.add(request_id)
        return None

    def _forget(self, request_id: int) -> None:
        self.sent.pop(request_id, None)
        self.controller.request_generators.pop(request_id, None)

    def local_work(self) -> int:
        return self.context.get_active_request_count() + len(self.engine.waiting_request_ids)

    # --- steps ------------------------------------------------------------------------------
    def step(self) -> list:
        """One engine step; the token deltas of this rank's requests."""
        engine = self.engine
        start = time.perf_counter()
        engine.schedule_waiting_requests()  # what async_forward does first; sized for the count below
        real_tokens = int(self.context.active_token_count)
        self.tokens_forwarded += real_tokens
        result = engine.step_modern()
        self.steps += 1
        self._harvest(start)
        self._count_activations(real_tokens)
        updates = []
        for rid in result["active_request_ids"]:
            entry = engine.requests.get(rid)
            if entry is not None:
                update = self._delta(rid, entry.record, finished=False)
                if update.tokens:
                    updates.append(update)
        for record in result["finished_request_records"]:
            rid = record.request_id
            failed = None
            status = record[-1].status
            if status is not None and status.name == "FAILED":
                events = [e for e in (record[-1].events or []) if getattr(e, "payload", None) is not None]
                failed = str(events[-1].payload) if events else "the engine refused the request"
            updates.append(self._delta(rid, record, finished=True, failed=failed))
            self._forget(rid)
        return updates

    def _delta(self, rid: int, record, *, finished: bool, failed=None) -> TokenUpdate:
        generated = [int(t) for r in record.requests for t in (r.generated_tokens or [])]
        start = self.sent.get(rid, 0)
        self.sent[rid] = len(generated)
        return TokenUpdate(rid, generated[start:], finished=finished, failed=failed)

    def dummy_step(self) -> None:
        """The forward an idle expert-parallel rank runs while its peers have work (upstream's
        ``run_engine_with_coordinator`` does the same: ``controller.dummy_forward()``)."""
        start = time.perf_counter()
        self.controller.dummy_forward()
        self.dummy_steps += 1
        self._harvest(start)
        self._count_activations(0)

    def _count_activations(self, real_tokens: int) -> None:
        """Count the last forward's routes: its first ``real_tokens`` tokens are requests' tokens
        (the dynamic context packs them first, then pads)."""
        if self.activations is None:
            return
        last = self.activations.recorder.last
        if any(t is None for t in last):  # a forward that routed nothing (e.g. no MoE layer ran)
            self.activations.recorder.last = [None] * len(last)
            return
        rows = int(last[0].shape[0])
        real = torch.zeros(1, rows, dtype=torch.bool)
        real[0, :min(real_tokens, rows)] = True
        self.activations.count(real)

    def _harvest(self, start: float) -> None:
        """Add the step's wall time and its all-to-all counters to the rank's totals and reset the
        layers' counters: their in-flight union keeps every interval, so summing the whole history
        at each ``stats()`` would cost more every step."""
        from moe_variants.common.moe_layer import comm_totals, reset_comm_counters

        self.busy_s += time.perf_counter() - start
        if self.counters:
            step = comm_totals([self.model])
            self.comm["a2a_bytes"] += int(step["bytes_dispatch"] + step["bytes_combine"] + step["bytes_meta"])
            self.comm["a2a_calls"] += int(step["calls"])
            self.comm["a2a_time_s"] += float(step["time_fwd_s"])
            self.comm["a2a_exposed_s"] += float(step["exposed_fwd_s"])
            reset_comm_counters([self.model])

    # --- counters ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """This rank's engine and all-to-all counters (plain numbers, for the frontend's metrics)."""
        allocator = self.context.block_allocator
        return {
            "requests_active": int(self.context.get_active_request_count()),
            "requests_waiting": len(self.engine.waiting_request_ids),
            "kv_blocks_total": int(allocator.total_count - 1),  # one block is the engine's dummy block
            "kv_blocks_used": int(allocator.total_count - 1 - allocator.total_avail),
            "tokens_forwarded": int(self.tokens_forwarded),
            "steps": self.steps,
            "dummy_steps": self.dummy_steps,
            "busy_s": float(self.busy_s),
            "requests_added": self.requests_added,
            "local_activations": int(self.activations.local.sum()) if self.activations else 0,
            "routed_activations": int(self.activations.total.sum()) if self.activations else 0,
            "activations_to_device": self.activations.to_device.tolist() if self.activations else [],  # [L][D]
            **self.comm,
        }


def kv_blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
