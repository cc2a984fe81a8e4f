"""megatron-core's dynamic inference engine over one of this project's checkpoints, on one rank.

``build_engine`` assembles the upstream pieces as Megatron-LM's own server does: the model from
``loading.load_model`` (any variant, at the requested TP/EP layout), megatron-core's
``GPTInferenceWrapper``, its ``DynamicInferenceContext`` (paged KV cache, continuous batching,
chunked prefill), a ``TextGenerationController`` and the ``DynamicInferenceEngine``. On CPU the
engine runs through ``megatron.compat.inference`` (plain-torch paged attention, batched over a
step's requests or, with ``paged_attention`` LOOP, the per-request reference; no NVTX).
Multi-latent attention (DeepSeek-V2/V3) is served as megatron-core serves it: the paged cache holds
each token's latent and rotary key in 64-token blocks, prefill uncompresses it, decode absorbs the
key up-projection into the query (FlashMLA, or its plain-torch equivalent);
``megatron.compat.mla`` closes the gaps of that path in 0.16.1. With tensor parallelism every
module runs without sequence parallelism (``replicate_activations``): each TP rank holds all of a
step's tokens outside the experts, as megatron-core's own inference does for MoE with TP and EP.

Ours is ``ServingController`` (a subclass of the upstream controller), which samples and scores
each request as it asked (``megatron.inference.sampling``):

- only the tokenizer's ids are candidates: the output layer has ``padded_vocab_size`` columns (a
  multiple of 128 x TP), its padding columns are cut off before sampling and scoring, so greedy
  decoding equals ``argmax`` over the tokenizer's vocabulary (what ``lm_eval_adapter`` takes);
- temperature, top-k and top-p apply together; unseeded requests draw from one generator seeded
  by ``--seed`` (mixed with the data-parallel rank), a request with its own ``seed`` from its own
  generator, made on the logits' device, so its tokens do not depend on the batch it shares;
  a chunk of a prefill that is not the last draws nothing;
- requests that ask get the log-probability of each sampled token and its most likely
  alternatives; a request that scores its prompt (``echo``) makes the model materialise every
  token's logits in the steps that prefill it (``materialize_only_last_token_logits`` off for
  that step only), and each prompt position is scored once, also across prefill chunks;
- a sampling error fails the requests it belongs to, not the step.

``RankEngine`` wraps the engine for the serving loop: add (refusing what can never be served:
ids outside the vocabulary, more tokens than the context or the KV cache holds) and cancel
requests, step, run the dummy forward of an idle expert-parallel rank, and report per-request
token deltas with their log-probs and the rank's KV-cache and (``routing_stats``) local-activation
counters (Sem-MoE's LAR: the (token, routed expert) pairs of real tokens whose expert sits on this
rank, counted from the routers' top-k; padding and dummy forwards are not counted). What else is
measured around a step subscribes to it (``subscribe``: a ``StepObserver`` is told each step's
``StepInfo`` before and after its forward and may add counters to ``stats()``): the server's
all-to-all counters and span recording are ``megatron.inference.observability``'s.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
import warnings
from typing import Optional

import torch

from megatron.common.cli import UserError, one_line
from megatron.compat.paged_attention import PagedAttention
from megatron.inference.sampling import RequestSampling, sample, token_logprobs
from moe_variants.registry import ServingModel

__all__ = ["EngineConfig", "RankEngine", "StepInfo", "StepObserver", "TokenUpdate", "STAT_FIELDS", "build_engine",
           "sampling_seed", "request_failure"]

MLA_BLOCK_SIZE = 64  # FlashMLA's block size; DynamicInferenceContext asserts it for the latent cache

_LOGGED_STACKS: set = set()  # (exception type, frames) whose traceback this process has logged


def request_failure(what: str, err: BaseException) -> str:
    """The one line a failed request's client gets, ``what: Type: message``; ``err``'s whole
    traceback goes to this rank's stderr, in full the first time its stack is seen and as one line
    after that (a bug every request hits logs one stack, not one per request)."""
    line = f"{what}: {type(err).__name__}: {one_line(err)}"
    stack = (type(err), tuple((f.filename, f.lineno) for f in traceback.extract_tb(err.__traceback__)))
    if stack in _LOGGED_STACKS:
        print(f"request failed: {line} (the same traceback as logged before)", file=sys.stderr, flush=True)
    else:
        _LOGGED_STACKS.add(stack)
        print(f"request failed: {line}\n{''.join(traceback.format_exception(err)).rstrip()}", file=sys.stderr,
              flush=True)
    return line


@dataclasses.dataclass
class EngineConfig:
    """Sizes of the engine on one rank (validated by ``validate``)."""

    max_batch_tokens: int = 512  # tokens in one forward (prefill chunks are cut to fit)
    max_requests: int = 16  # requests decoding at once
    kv_cache_gb: float = 0.25  # paged KV-cache buffer per rank
    block_size_tokens: Optional[int] = None  # None: 256 with flash-attn kernels, else 32
    max_sequence_length: Optional[int] = None  # prompt + output; None: the checkpoint's seq_length
    seed: int = 1234
    paged_attention: PagedAttention = PagedAttention.BATCHED  # without flash-attn/FlashMLA: batched or loop

    def validate(self) -> None:
        if self.max_batch_tokens < 1:
            raise UserError(f"--max-batch-tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_requests < 1:
            raise UserError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.max_batch_tokens < self.max_requests:
            raise UserError(f"--max-batch-tokens ({self.max_batch_tokens}) must be >= --max-requests "
                            f"({self.max_requests}): a decode step feeds one token per request")
        if not self.kv_cache_gb > 0:
            raise UserError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.block_size_tokens is not None and self.block_size_tokens < 1:
            raise UserError(f"--block-size-tokens must be >= 1, got {self.block_size_tokens}")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise UserError(f"--max-sequence-length must be >= 2, got {self.max_sequence_length}")


def _controller_class():
    from megatron.compat.inference import sampling_controller_class

    class ServingController(sampling_controller_class()):
        """``TextGenerationController`` that samples and scores each request as it asked (see the
        module docstring). Upstream's own sampling buckets and log-prob path are not used: they
        refuse top-k with top-p, share one generator, and key top-N log-probs by token text."""

        def __init__(self, inference_wrapped_model, tokenizer, *, vocab_size: int, seed: int = 0,
                     pp_group=None):
            super().__init__(inference_wrapped_model, tokenizer, pp_group)
            self.vocab_size = int(vocab_size)
            self.seed = int(seed)
            self.rng: Optional[torch.Generator] = None  # unseeded requests' generator (made on first use)
            self.specs: dict[int, RequestSampling] = {}
            self.generators: dict[int, torch.Generator] = {}  # seeded requests' own
            self.prompts: dict[int, list] = {}  # prompts of requests that score them
            self.prompt_scored: dict[int, int] = {}  # request -> prompt positions scored so far
            self.logprobs: dict[int, list] = {}  # request -> LogprobEntry per sampled token
            self.prompt_logprobs: dict[int, list] = {}  # request -> new prompt entries (taken by RankEngine)
            self.failed: dict[int, str] = {}  # request -> why its sampling failed (taken by RankEngine)

        # --- requests ---------------------------------------------------------------------
        def admit(self, request_id: int, spec: RequestSampling, prompt: list) -> None:
            self.specs[request_id] = spec
            if spec.logprobs is not None:
                self.logprobs[request_id] = []
            if spec.prompt_logprobs:
                self.prompts[request_id] = list(prompt)
                self.prompt_scored[request_id] = 0
                self.prompt_logprobs[request_id] = []

        def forget(self, request_id: int) -> None:
            for table in (self.specs, self.generators, self.prompts, self.prompt_scored, self.logprobs,
                          self.prompt_logprobs, self.failed):
                table.pop(request_id, None)

        def _generator(self, request_id: int, spec: RequestSampling, device) -> torch.Generator:
            if spec.seed is None:
                if self.rng is None or self.rng.device != device:
                    self.rng = torch.Generator(device=device).manual_seed(self.seed)
                return self.rng
            gen = self.generators.get(request_id)
            if gen is None:
                gen = self.generators[request_id] = torch.Generator(device=device).manual_seed(spec.seed)
            return gen

        # --- one step -----------------------------------------------------------------------
        def _scores_prompt_this_step(self) -> bool:
            context = self.inference_wrapped_model.inference_context
            ids = context.request_ids[context.paused_request_count:context.total_request_count].tolist()
            return any(rid in self.prompts and self.prompt_scored[rid] < len(self.prompts[rid]) - 1 for rid in ids)

        def before_step_context(self) -> None:
            # every token's logits only in a step that scores some request's prompt
            context = self.inference_wrapped_model.inference_context
            context.materialize_only_last_token_logits = not self._scores_prompt_this_step()

        def sample_step(self, logits):
            context = self.inference_wrapped_model.inference_context
            active = slice(context.paused_request_count, context.total_request_count)
            ids = context.request_ids[active].tolist()
            full = not context.materialize_only_last_token_logits
            last_BV = (context.last_token_logits(logits) if full else logits.squeeze(0))[:, :self.vocab_size]
            tokens_B = torch.argmax(last_BV, dim=-1)  # greedy, and the chunked prefill's unused token
            groups: dict = {}
            for i, rid in enumerate(ids):
                spec = self.specs.get(rid)
                if spec is None or spec.greedy or rid == context.chunked_prefill_request_id:
                    continue  # no RNG draw for a chunk: seeded output must not depend on chunking
                key = ("seed", rid) if spec.seed is not None else spec.bucket()
                groups.setdefault(key, []).append(i)
            for rows in groups.values():
                spec = self.specs[ids[rows[0]]]
                try:
                    gen = self._generator(ids[rows[0]], spec, last_BV.device)
                    tokens_B[rows] = sample(last_BV[rows], spec, gen)
                except Exception as err:  # fails these requests only (RankEngine finishes them)
                    reason = request_failure("sampling failed", err)
                    for i in rows:
                        self.failed[ids[i]] = reason
            self._score(ids, last_BV, tokens_B, logits if full else None)
            context.materialize_only_last_token_logits = True
            return tokens_B

        def _score(self, ids: list, last_BV, tokens_B, logits) -> None:
            """Log-probs of the sampled tokens and, with all logits, of the prompt tokens."""
            context = self.inference_wrapped_model.inference_context
            rows = [i for i, rid in enumerate(ids) if rid in self.logprobs and rid != context.chunked_prefill_request_id]
            if rows:
                top_n = max(self.specs[ids[i]].logprobs for i in rows)
                for i, entry in zip(rows, token_logprobs(last_BV[rows], tokens_B[rows], top_n)):
                    n = self.specs[ids[i]].logprobs
                    self.logprobs[ids[i]].append((entry[0], entry[1], entry[2][:n]))
            if logits is None:
                return
            active = slice(context.paused_request_count, context.total_request_count)
            lengths = context.request_query_lengths[active].tolist()
            offsets = context.request_kv_length_offsets[active].tolist()  # position of each request's first row
            all_TV = logits.squeeze(0)[:, :self.vocab_size]
            start = 0
            for i, rid in enumerate(ids):
                row0, start = start, start + lengths[i]
                prompt = self.prompts.get(rid)
                if prompt is None:
                    continue
                # row j predicts position offsets[i] + j + 1; score prompt positions not yet scored
                lo = max(self.prompt_scored[rid] + 1, offsets[i] + 1)
                hi = min(len(prompt), offsets[i] + lengths[i] + 1)
                if lo >= hi:
                    continue
                first = row0 + lo - 1 - offsets[i]
                targets = torch.tensor(prompt[lo:hi], device=all_TV.device)
                entries = token_logprobs(all_TV[first:first + hi - lo], targets, self.specs[rid].logprobs)
                self.prompt_logprobs[rid].extend(entries)
                self.prompt_scored[rid] = hi - 1

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
    """New tokens of one request since the last report (a rank -> the frontend).

    ``logprobs``: a ``LogprobEntry`` per new token (requests that asked); ``prompt_logprobs``: new
    entries of the prompt's positions 1.. (requests that score their prompt). ``failed``: why the
    request failed (it is finished); ``status``: the HTTP status that failure maps to."""

    request_id: int
    tokens: list
    finished: bool = False
    failed: Optional[str] = None
    status: int = 500
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None


def replicate_activations(model) -> int:
    """Turn sequence parallelism off in every module of ``model`` (serving with TP > 1): every
    tensor-parallel rank then holds all of a step's tokens outside the experts, as megatron-core's
    own inference does for MoE models with TP and EP (``text_generation_controller.py:1112-1125``;
    its ``exclude_modules=[BaseMoELayer]`` compares module instances with the class and so
    excludes nothing). Returns the number of modules changed."""
    changed = 0
    model.config.sequence_parallel = False
    for module in model.modules():
        for attr in ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(module, attr, False) is True:
                setattr(module, attr, False)
                changed += 1
    return changed


def sampling_seed(seed: int, pg_collection) -> int:
    """The generator seed of unseeded requests on this rank: ``--seed`` mixed with the
    data-parallel rank (tensor-parallel peers hold the same requests and must draw alike; two
    data-parallel ranks must not draw the same tokens for the same prompt)."""
    import torch.distributed as dist

    dp_rank = dist.get_rank(pg_collection.dp) if pg_collection.dp is not None else 0
    return (int(seed) + 0x9E3779B97F4A7C15 * dp_rank) % 2**63


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
    applied = apply_inference(cfg.paged_attention)
    config = model.config
    mla = bool(getattr(config, "multi_latent_attention", False))
    if pg_collection.pp.size() != 1:
        raise UserError("--pipeline-model-parallel-size must be 1 for serving")
    seq_length = cfg.max_sequence_length or configs.model.seq_length
    max_positions = configs.model.max_position_embeddings or configs.model.seq_length
    if configs.model.position_embedding_type == "learned_absolute" and seq_length > max_positions:
        raise UserError(f"--max-sequence-length {seq_length} exceeds the model's {max_positions} "
                        "learned positions")
    block = cfg.block_size_tokens or (256 if applied["attention_kernels"] == "flash-attn" else 32)
    if mla:
        # megatron-core serves MLA from its latent cache only, in FlashMLA's 64-token blocks
        if cfg.block_size_tokens not in (None, MLA_BLOCK_SIZE):
            raise UserError(f"--block-size-tokens {cfg.block_size_tokens}: multi-latent attention caches latents "
                            f"in blocks of {MLA_BLOCK_SIZE} tokens (FlashMLA's)")
        block = MLA_BLOCK_SIZE
        from megatron.compat.mla import use_latent_cache

        use_latent_cache(model)
        if applied["mla_decode_kernel"] == "torch" and torch.cuda.is_available():
            warnings.warn("FlashMLA is not installed: multi-latent attention decodes with the plain-torch "
                          "equivalent (megatron.compat.paged_attention): correct, slow; "
                          "pip install flash-mla for the kernel", stacklevel=2)
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
        cache_mla_latent=mla,
        kv_lora_rank=config.kv_lora_rank if mla else None,
        qk_pos_emb_head_dim=config.qk_pos_emb_head_dim if mla else None,
        materialize_only_last_token_logits=True,
        use_cuda_graphs_for_non_decode_steps=False,
        use_flashinfer_fused_rope=False,
    )
    if pg_collection.tp.size() > 1:
        replicate_activations(model)
    wrapped = GPTInferenceWrapper(model, wrapper_config, context, pg_collection=pg_collection)
    wrapped.prep_model_for_inference()
    controller = _controller_class()(wrapped, _TokenizerForEngine(tokenizer), vocab_size=tokenizer.vocab_size,
                                     seed=sampling_seed(cfg.seed, pg_collection), pp_group=pg_collection.pp)
    engine = DynamicInferenceEngine(controller, context, random_seed=int(cfg.seed), pg_collection=pg_collection)
    return engine, controller, context


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One engine step as its observers see it: ``start`` and ``end`` in ``time.perf_counter()``
    seconds (``end`` is None before the forward), ``real_tokens`` the requests' tokens it forwards
    (0 for a dummy forward, or for a step whose requests all wait and which runs none), ``dummy``
    for the forward of an idle expert-parallel rank."""

    start: float
    real_tokens: int
    dummy: bool = False
    end: Optional[float] = None


class StepObserver:
    """What ``RankEngine.subscribe`` takes: told of every step and dummy forward, in subscription
    order. The defaults do nothing."""

    def step_start(self, step: StepInfo) -> None:
        """Before the step's forward (``step.end`` is None)."""

    def step_end(self, step: StepInfo) -> None:
        """After it: the same step with its ``end``."""

    def stats(self) -> dict:
        """Counters this observer adds to ``RankEngine.stats()`` (plain numbers)."""
        return {}


class RankEngine:
    """One rank's engine as the serving loop drives it (see the module docstring)."""

    def __init__(self, engine, controller, context, model, *, ep_rank: Optional[int] = 0, ep_size: int = 1,
                 routing_stats: bool = False, serving_model: Optional[ServingModel] = None):
        """``routing_stats``: count local activations (Sem-MoE's LAR; defined for attention-DP,
        TP = 1, or where a variant's ``serving_model`` says which rows of an MoE layer's forward
        are real tokens: ``ep_rank`` None turns it off). Off by default: the routers' observers
        read their top-k on the host in every MoE layer of every forward."""
        from moe_variants.common.moe_layer import moe_layers

        self.model = model
        self.engine = engine
        self.controller = controller
        self.context = context
        self.observers: list[StepObserver] = []
        self.sent: dict[int, int] = {}  # request id -> tokens already reported
        self.failed: set = set()  # requests reported failed whose engine entry is still finishing
        self.tokens_forwarded = 0  # real (unpadded) tokens through the model
        self.steps = 0
        self.dummy_steps = 0
        self.busy_s = 0.0  # wall time inside engine steps and dummy forwards
        self.requests_added = 0
        self.activations = None  # LocalActivationCounter when counting and every router reports its top-k
        self.serving_model = serving_model
        layers = moe_layers(model)
        if routing_stats and ep_rank is not None and layers and all(hasattr(m.router, "routing_observer") for m in layers):
            from moe_variants.common.routing import LocalActivationCounter

            self.activations = LocalActivationCounter(model, ep_rank, ep_size).__enter__()

    def subscribe(self, observer: StepObserver) -> None:
        """Tell ``observer`` of every step from now on (after the observers subscribed before it)."""
        self.observers.append(observer)

    def unsubscribe(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request may hold: the KV blocks a request can use (all but
        the engine's dummy block and the paused reserve) times the block size."""
        return int(self.context.block_allocator.active_count) * int(self.context.block_size_tokens)

    # --- requests ---------------------------------------------------------------------------
    def add(self, request_id: int, prompt: list, *, max_tokens: int, sampling: RequestSampling,
            termination_id: int) -> None:
        """Queue a request. Raises ``ValueError`` for one the engine could never serve (the
        frontend refuses those first; this guards every other caller)."""
        from megatron.core.inference.sampling_params import SamplingParams

        vocab = self.controller.vocab_size
        if not prompt or any(not 0 <= int(t) < vocab for t in prompt):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {vocab}) and not empty")
        if len(prompt) + max_tokens > self.context.max_sequence_length:
            raise ValueError(f"request {request_id}: {len(prompt)} prompt + {max_tokens} output tokens exceed the "
                             f"context of {self.context.max_sequence_length}")
        if len(prompt) + max_tokens > self.max_request_tokens:
            raise ValueError(f"request {request_id}: {len(prompt)} prompt + {max_tokens} output tokens exceed the "
                             f"{self.max_request_tokens} tokens of KV cache a request can hold")
        if request_id in self.sent or request_id in self.engine.requests:
            raise ValueError(f"request {request_id} was added twice")
        # upstream's own sampling fields are unused (ServingController samples from ``sampling``)
        params = SamplingParams(temperature=1.0, top_k=1, top_p=0.0, num_tokens_to_generate=int(max_tokens),
                                termination_id=int(termination_id))
        self.controller.admit(request_id, sampling, prompt)
        self.sent[request_id] = 0
        try:
            self.engine.add_request(request_id, [int(t) for t in prompt], params)
        except BaseException:
            self.engine.requests.pop(request_id, None)
            self._forget(request_id)
            raise
        self.requests_added += 1

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

    def fail(self, request_id: int) -> None:
        """Drop a request that failed, here or on a tensor-parallel peer (the loop agrees on its
        failures): cancelled as by ``cancel``, and nothing more of it is reported (an active one's
        engine entry finishes at the next step; its record is dropped then)."""
        if self.cancel(request_id) is None and request_id in self.engine.requests:
            self.failed.add(request_id)
        self._forget(request_id)

    def request_lengths(self) -> dict:
        """``{request id: (prompt tokens, generated tokens, prompt tokens still to prefill)}`` of
        every request in the engine, active or waiting: what its next steps batch. The loop
        compares a digest of it across each tensor-parallel group."""
        out = {}
        for rid, entry in self.engine.requests.items():
            record = entry.record
            out[rid] = (len(record[0].prompt_tokens), sum(len(r.generated_tokens or []) for r in record.requests),
                        record[-1].remaining_prompt_length)
        return out

    def _forget(self, request_id: int) -> None:
        self.sent.pop(request_id, None)
        self.controller.forget(request_id)

    def local_work(self) -> int:
        return self.context.get_active_request_count() + len(self.engine.waiting_request_ids)

    # --- steps ------------------------------------------------------------------------------
    def step(self) -> tuple:
        """One engine step: (token deltas of this rank's requests, whether a forward ran). A step
        whose requests all wait (no KV blocks free yet) runs none: its expert-parallel peers must
        then be matched by a dummy forward (the loop does that)."""
        from megatron.compat.inference import step_scheduled

        engine = self.engine
        start = time.perf_counter()
        engine.schedule_waiting_requests()  # what async_forward does first; sized for the count below
        real_tokens = int(self.context.active_token_count)
        step = self._start(StepInfo(start, real_tokens))
        self.tokens_forwarded += real_tokens
        result = step_scheduled(engine)  # without scheduling again
        forwarded = real_tokens > 0
        self.steps += int(forwarded)
        self._end(step)
        if forwarded:
            self._count_activations(real_tokens)
        failed_now = dict(self.controller.failed)
        self.controller.failed.clear()
        updates = []
        for rid in result["active_request_ids"]:
            entry = engine.requests.get(rid)
            if rid in failed_now:
                updates.append(TokenUpdate(rid, [], finished=True, failed=failed_now.pop(rid)))
                self.fail(rid)
            elif entry is not None and rid not in self.failed:
                update = self._delta(rid, entry.record, finished=False)
                if update.tokens:
                    updates.append(update)
        for record in result["finished_request_records"]:
            rid = record.request_id
            if rid in self.failed:
                self.failed.discard(rid)
                continue
            failed = failed_now.pop(rid, None)
            status = record[-1].status
            if failed is None and status is not None and status.name == "FAILED":
                events = [e for e in (record[-1].events or []) if getattr(e, "payload", None) is not None]
                failed = str(events[-1].payload) if events else "the engine refused the request"
            updates.append(self._delta(rid, record, finished=True, failed=failed))
            self._forget(rid)
        return updates, forwarded

    def _delta(self, rid: int, record, *, finished: bool, failed=None) -> TokenUpdate:
        generated = [int(t) for r in record.requests for t in (r.generated_tokens or [])]
        start = self.sent.get(rid, 0)
        self.sent[rid] = len(generated)
        entries = self.controller.logprobs.get(rid)
        prompt_entries = None
        if len(generated) > start or finished:  # reported: the update is sent (chunk steps send none)
            prompt_entries = self.controller.prompt_logprobs.get(rid)
            if prompt_entries:
                self.controller.prompt_logprobs[rid] = []
        return TokenUpdate(rid, generated[start:], finished=finished, failed=failed,
                           logprobs=entries[start:len(generated)] if entries is not None else None,
                           prompt_logprobs=prompt_entries or None)

    def dummy_step(self) -> None:
        """The forward an idle expert-parallel rank runs while its peers have work (upstream's
        ``run_engine_with_coordinator`` does the same: ``controller.dummy_forward()``)."""
        step = self._start(StepInfo(time.perf_counter(), 0, dummy=True))
        self.controller.dummy_forward()
        self.dummy_steps += 1
        self._end(step)
        self._count_activations(0)

    def _start(self, step: StepInfo) -> StepInfo:
        for observer in self.observers:
            observer.step_start(step)
        return step

    def _end(self, step: StepInfo) -> None:
        end = time.perf_counter()
        self.busy_s += end - step.start
        step = dataclasses.replace(step, end=end)
        for observer in self.observers:
            observer.step_end(step)

    def _count_activations(self, real_tokens: int) -> None:
        """Count the last forward's routes: its first ``real_tokens`` tokens are requests' tokens
        (the dynamic context packs them first, then pads)."""
        if self.activations is None:
            return
        last = self.activations.recorder.last
        if any(t is None for t in last):  # a forward that routed nothing (e.g. no MoE layer ran)
            self.activations.recorder.last = [None] * len(last)
            return
        if self.serving_model is not None:  # each layer's rows are its own share of the step's tokens
            rows = [self.serving_model.local_rows(layer, real_tokens) for layer in range(len(last))]
            self.activations.count_layers(rows)
            return
        rows = int(last[0].shape[0])
        real = torch.zeros(1, rows, dtype=torch.bool)
        real[0, :min(real_tokens, rows)] = True
        self.activations.count(real)

    # --- counters ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """This rank's engine counters and its observers' (``STAT_FIELDS``, plain numbers; a field
        no observer reports is 0, e.g. the all-to-all counters of an engine nothing watches)."""
        allocator = self.context.block_allocator
        stats = dict.fromkeys(STAT_FIELDS, 0)
        for observer in self.observers:
            stats.update(observer.stats())
        return stats | {
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
        }

    def routing_matrix(self) -> list:
        """[L][D] routed (real token, expert) pairs whose expert is on each device ([] when not
        counting)."""
        return self.activations.to_device.tolist() if self.activations else []


STAT_FIELDS = ("requests_active", "requests_waiting", "kv_blocks_total", "kv_blocks_used", "tokens_forwarded",
               "steps", "dummy_steps", "busy_s", "requests_added", "local_activations", "routed_activations",
               "a2a_bytes", "a2a_calls", "a2a_time_s", "a2a_exposed_s")


