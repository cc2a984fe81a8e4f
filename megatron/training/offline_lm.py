"""The checkpoint's model as a batch scorer and greedy generator, for many ranks at any TP/EP layout.

``CheckpointLM.from_checkpoint(path, tensor_model_parallel_size=, expert_model_parallel_size=)``
rebuilds the model from the checkpoint's own configs (``loading.load_model``: FarSkip connectivity
and BigMac layers come with them) and its tokenizer (``loading.load_tokenizer``); ``GreedyBatch``
decodes a batch of prompts with it. Nothing here needs lm-eval: the lm-eval ``LM``
(``lm_eval_adapter.MegatronCheckpointLM``) adds the harness's request API on top, and the serving
tests and the GPU tier use this module as the offline reference for served tokens.

**Generation** is greedy, row by row equal to: predict the next token from the last
``seq_length`` tokens of prompt + generated text, stop at the EOD token, at any ``until`` string
(the text is cut before it) or after ``max_new`` tokens. A batch advances one position at a time
from its shortest prompt (rows still inside their prompt take the prompt token, as megatron-core's
static-batching generation does), so no row ever attends to padding. Two ways to compute the same
thing:

* ``kv_cache``: megatron-core's ``StaticInferenceContext`` (one prefill, then one token per step;
  the context must fit ``seq_length``, after which the batch continues by recompute with a sliding
  window). Used when TP == 1, FarSkip models included (their block takes the inference-mode input
  and context like megatron-core's ``TransformerBlock``; token-identical to recompute, tested).
* ``recompute``: a full forward over the last ``seq_length`` tokens per step. Used with TP > 1:
  megatron-core requires sequence parallelism for MoE there, which splits the token dimension over
  TP ranks, so a one-token decoding step cannot be split.

Only pipeline parallelism 1 is supported (every rank must hold the output layer).

Shape suffixes: ``B`` batch rows, ``S`` sequence positions, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.common import collectives
from megatron.common.cli import UserError

__all__ = [
    "CheckpointLM",
    "GenJob",
    "GenerationMode",
    "GreedyBatch",
    "Ranks",
    "continuation_score",
    "greedy_stop",
    "scoring_window",
]


class GenerationMode(str, enum.Enum):
    """How greedy generation computes each step (same tokens either way; see the module docstring)."""

    auto = "auto"
    kv_cache = "kv_cache"
    recompute = "recompute"


# --- pure helpers ------------------------------------------------------------------------------


def scoring_window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], int]:
    """(tokens, num_scored): the last ``max_length + 1`` tokens of context + continuation, and how
    many of its final tokens are continuation tokens to score (all of them unless the continuation
    alone is longer than ``max_length``; then its first tokens cannot be scored with any context)."""
    tokens = (list(context) + list(continuation))[-(max_length + 1):]
    return tokens, min(len(continuation), len(tokens) - 1)


def continuation_score(logits_SV: torch.Tensor, targets_S: torch.Tensor) -> tuple[float, bool]:
    """Sum of the targets' log-probabilities under ``logits_SV`` (fp32 log-softmax over V) and
    whether every target is the argmax (lm-eval's ``is_greedy``). Row s predicts ``targets_S[s]``.
    The sum is taken in fp64, as lm-eval sums a served model's per-token log-probs: in fp32 a
    500-token window's sum is off by ~1e-4 nats (its rounding step at ~-2500)."""
    logp_SV = F.log_softmax(logits_SV.float(), dim=-1)
    score = logp_SV.gather(-1, targets_S[:, None]).double().sum()
    greedy = bool((logp_SV.argmax(-1) == targets_S).all())
    return float(score), greedy


def greedy_stop(text: str, until: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the first occurrence of each stop string in turn (lm-eval's HF order),
    and whether any stop string occurred."""
    hit = False
    for term in until:
        if term and term in text:
            text, hit = text.split(term)[0], True
    return text, hit


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, default=repr).encode()).hexdigest()


# --- ranks ---------------------------------------------------------------------------------------


class Ranks:
    """Agreement over the world and result exchange over the data-parallel group."""

    def __init__(self, dp_group):
        self.dp_group = dp_group
        self.dp_rank = dist.get_rank(dp_group)
        self.dp_size = dist.get_world_size(dp_group)
        self.assigned: list[int] = [0] * self.dp_size  # requests each DP rank ran, over every call

    @staticmethod
    def max(value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64)
        collectives.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def mine(self, order: list[int], batch_size: int, tokens_of=None, scheduler=None) -> list[list[int]]:
        """This rank's batches of request indices. ``order`` is every request, longest first.

        Without a ``scheduler`` the batches of ``order`` are dealt round-robin over the ranks.
        With one (e.g. Sem-MoE's Algorithm 2), ``scheduler(token_lists)`` gives each request's
        rank, the requests taken in lm-eval's order (their arrival order); each rank then batches
        its own requests, longest first. Every rank computes the same assignment.
        """
        if scheduler is None:
            batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
            counts = [sum(len(b) for b in batches[q::self.dp_size]) for q in range(self.dp_size)]
            self.assigned = [a + c for a, c in zip(self.assigned, counts)]
            return batches[self.dp_rank::self.dp_size]
        arrival = sorted(order)
        ranks = [int(r) for r in scheduler([list(tokens_of(i)) for i in arrival])]
        if len(ranks) != len(arrival) or any(not 0 <= r < self.dp_size for r in ranks):
            raise ValueError(f"the request scheduler must give a rank in [0, {self.dp_size}) per request")
        owner = dict(zip(arrival, ranks))
        counts = [sum(1 for r in ranks if r == q) for q in range(self.dp_size)]
        self.assigned = [a + c for a, c in zip(self.assigned, counts)]
        own = [i for i in order if owner[i] == self.dp_rank]
        return [own[i:i + batch_size] for i in range(0, len(own), batch_size)]

    def gather(self, results: dict) -> dict:
        parts = [None] * self.dp_size
        collectives.all_gather_object(parts, results, group=self.dp_group)
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    @staticmethod
    def check_same(kind: str, payload) -> None:
        mine = digest(payload)
        every = [None] * dist.get_world_size()
        collectives.all_gather_object(every, mine)
        if len(set(every)) != 1:
            raise RuntimeError(
                f"{kind}: ranks received different requests (every rank must run the same tasks, "
                "limit, few-shot and seeds); refusing to continue rather than hang in a collective"
            )


# --- the model -------------------------------------------------------------------------------------


class CheckpointLM:
    """A megatron-core ``GPTModel`` of this project with its tokenizer, run in lockstep on every rank
    (see the module docstring; ``lm_eval_adapter.MegatronCheckpointLM`` adds lm-eval's request API).

    Args:
        model: the rank's model (eval mode), built for ``pg_collection``'s layout.
        tokenizer: the checkpoint's tokenizer (``tokenize``/``detokenize``/``eod``/``vocab_size``).
        max_length: tokens the model reads at once (the checkpoint's ``seq_length``).
        pg_collection: megatron-core process groups (``dp`` and ``tp`` are read).
        batch_size: sequences per forward.
        max_gen_toks: default generation budget when a request does not give one.
        generation: ``GenerationMode`` (``auto`` picks ``kv_cache`` where it is supported).
        request_scheduler: ``f(token_lists) -> rank per request`` over the data-parallel ranks
            (attention-DP request scheduling, e.g. ``moe_variants.semmoe.scheduling.request_scheduler``);
            default: length-sorted batches dealt round-robin. ``loglikelihood_rolling`` schedules
            each disjoint window as a request (each is one sequence of its own).
        forward_observer: called after every model forward with a [B, S] bool mask of the tokens
            that belong to requests (False: right padding, lockstep dummies, rows of a generation
            batch that have finished), e.g. ``moe_variants.common.routing.LocalActivationCounter.count``.
    """

    def __init__(self, model, tokenizer, *, max_length: int, pg_collection, batch_size: int = 8,
                 max_gen_toks: int = 256, generation: GenerationMode = GenerationMode.auto,
                 capacity_factor: Optional[float] = None, request_scheduler=None, forward_observer=None):
        super().__init__()  # lm-eval's LM.__init__ when mixed into MegatronCheckpointLM
        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        if max_length < 2:
            raise UserError(f"the model's seq_length ({max_length}) is too short to evaluate")
        if pg_collection.pp.size() != 1:
            raise UserError("--pipeline-model-parallel-size must be 1 for evaluation")
        self.model = model
        self.tokenizer = tokenizer
        self._max_length = int(max_length)
        self._batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self._ranks = Ranks(pg_collection.dp)
        self._scheduler = request_scheduler
        self.forward_observer = forward_observer  # settable once the model exists
        self.pg_collection = pg_collection
        self._tp = pg_collection.tp.size()
        self._vocab = tokenizer.vocab_size
        from megatron.components.parallel import device

        self._device = device()
        mode = GenerationMode(generation)
        reason = self.kv_cache_unsupported_reason()
        if mode == GenerationMode.kv_cache and reason:
            raise UserError(f"--generation kv_cache: {reason}")
        self.generation = (GenerationMode.recompute if reason else GenerationMode.kv_cache) \
            if mode == GenerationMode.auto else mode
        if capacity_factor is not None:
            warnings.warn(
                f"the checkpoint's MoE drops tokens (moe_expert_capacity_factor={capacity_factor}): "
                "scores depend on how requests are batched and on the layout", stacklevel=2)

    @classmethod
    def from_checkpoint(cls, path: str, *, tensor_model_parallel_size: int = 1,
                        expert_model_parallel_size: int = 1, seed: int = 1234, max_length: Optional[int] = None,
                        **kwargs) -> "CheckpointLM":
        """Initialise the layout (torch.distributed must already be initialised), load the model at
        it and wrap it. ``max_length``: tokens read at once (default and upper bound: the
        checkpoint's ``seq_length``). Layout errors are ``UserError``s naming the flag."""
        from moe_variants.config import ParallelConfig, validate
        from megatron.components.loading import checkpoint_configs, load_model
        from megatron.components.parallel import initialize_parallel

        configs, _, _ = checkpoint_configs(path)
        seq_length = configs.model.seq_length
        if max_length is not None and not 2 <= max_length <= seq_length:
            raise UserError(f"--max-length must be in [2, {seq_length}] (the checkpoint's seq_length), got {max_length}")
        parallel = ParallelConfig(tensor_model_parallel_size=tensor_model_parallel_size,
                                  expert_model_parallel_size=expert_model_parallel_size)
        world = dist.get_world_size()
        validate(configs.model, parallel, world)
        if world % tensor_model_parallel_size:
            raise UserError(f"--tensor-model-parallel-size {tensor_model_parallel_size} does not divide "
                            f"the {world} ranks")
        pgc = initialize_parallel(parallel, seed=seed)
        model, configs, tokenizer, _ = load_model(path, parallel=parallel, pg_collection=pgc)
        return cls(model, tokenizer, max_length=max_length or configs.model.seq_length, pg_collection=pgc,
                   capacity_factor=configs.model.moe_expert_capacity_factor, **kwargs)

    # --- properties (lm-eval's names) -------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tokenizer)

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return list(self.tokenizer.tokenize(string))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.detokenize(list(tokens))

    def kv_cache_unsupported_reason(self) -> Optional[str]:
        """Why KV-cached generation cannot be used with this model/layout, or None."""
        if self._tp > 1:
            return ("with TP > 1 sequence parallelism splits the tokens over TP ranks and a "
                    "one-token decoding step cannot be split")
        return None

    # --- model calls ------------------------------------------------------------------------
    def _forward(self, tokens_BS: torch.Tensor, inference_context=None, position_ids_BS=None,
                 real_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, S, V] (fp32, tokenizer vocabulary). Without a cache, S is padded to a multiple
        of TP (sequence parallelism) with trailing tokens that the causal mask keeps invisible.
        ``real_BS``: the tokens that belong to requests, for the forward observer (default all)."""
        from moe_variants.builder import causal_attention_mask

        num_b, num_s = tokens_BS.shape
        if real_BS is None:
            real_BS = torch.ones((num_b, num_s), dtype=torch.bool)
        pad = 0
        if inference_context is None:
            pad = (-num_s) % self._tp
            if pad:
                tokens_BS = torch.cat([tokens_BS, tokens_BS.new_full((num_b, pad), self.eot_token_id)], 1)
            mask = causal_attention_mask(num_s + pad, device=self._device)
        else:
            mask = None if inference_context.is_decode_only() else causal_attention_mask(num_s, device=self._device)
        if position_ids_BS is None:
            position_ids_BS = torch.arange(tokens_BS.shape[1])[None].expand_as(tokens_BS)
        with torch.no_grad():
            logits_BSV = self.model(tokens_BS.to(self._device), position_ids_BS.to(self._device), mask,
                                    inference_context=inference_context, runtime_gather_output=True)
        if self.forward_observer is not None:
            self.forward_observer(F.pad(real_BS.bool(), (0, pad), value=False))
        if inference_context is None:
            logits_BSV = logits_BSV[:, :num_s]
        return logits_BSV[..., :self._vocab].float()

    def _dummy_forward(self) -> None:
        """A forward whose output is dropped: keeps this rank in the collectives of its peers."""
        self._forward(torch.full((1, 1), self.eot_token_id, dtype=torch.long),
                      real_BS=torch.zeros((1, 1), dtype=torch.bool))


@dataclasses.dataclass
class GenJob:
    """One generation request: prompt token ids, stop strings, and the most tokens to generate."""

    prompt: list[int]
    until: list[str]
    max_new: int


class GreedyBatch:
    """One batch advancing a shared position ``pos`` (tokens ``[0, pos)`` are known in every row)."""

    def __init__(self, lm: CheckpointLM, jobs: list[GenJob]):
        self.lm = lm
        self.jobs = jobs
        self.seqs = [list(j.prompt) for j in jobs]
        self.generated: list[list[int]] = [[] for _ in jobs]
        self.done = [j.max_new == 0 for j in jobs]
        self.pos = min(len(j.prompt) for j in jobs)
        self.cache = None
        if lm.generation == GenerationMode.kv_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.cache = StaticInferenceContext(len(jobs), lm.max_length)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def _next_logits_BV(self) -> torch.Tensor:
        L, pos = self.lm.max_length, self.pos
        live_B = torch.tensor([not d for d in self.done])  # finished rows feed fillers
        if self.cache is not None and pos <= L:
            cache = self.cache
            if cache.sequence_len_offset == 0:  # prefill [0, pos)
                tokens_BS = torch.tensor([s[:pos] for s in self.seqs])
                logits = self.lm._forward(tokens_BS, cache, real_BS=live_B[:, None].expand_as(tokens_BS))
                cache.sequence_len_offset = pos
                cache.enable_decode_mode()
            else:  # one token, position pos - 1
                tokens_BS = torch.tensor([[s[pos - 1]] for s in self.seqs])
                positions = torch.full_like(tokens_BS, pos - 1)
                logits = self.lm._forward(tokens_BS, cache, positions, real_BS=live_B[:, None].expand_as(tokens_BS))
                cache.sequence_len_offset += 1
            return logits[:, -1]
        start = max(0, pos - L)  # sliding window of the last L tokens
        tokens_BS = torch.tensor([s[start:pos] for s in self.seqs])
        return self.lm._forward(tokens_BS, real_BS=live_B[:, None].expand_as(tokens_BS))[:, -1]

    def step(self) -> None:
        next_B = self._next_logits_BV().argmax(-1).tolist()
        eod = self.lm.eot_token_id
        for b, job in enumerate(self.jobs):
            if self.pos < len(job.prompt):  # still inside this row's prompt
                continue
            if self.done[b]:
                self.seqs[b].append(eod)  # filler keeping the rows aligned
                continue
            token = next_B[b]
            self.seqs[b].append(token)
            if token == eod:
                self.done[b] = True
                continue
            self.generated[b].append(token)
            _, hit = greedy_stop(self.lm.tok_decode(self.generated[b]), job.until)
            if hit or len(self.generated[b]) >= job.max_new:
                self.done[b] = True
        self.pos += 1

    def texts(self) -> list[str]:
        return [greedy_stop(self.lm.tok_decode(g), job.until)[0] for g, job in zip(self.generated, self.jobs)]
