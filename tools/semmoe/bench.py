"""Sem-MoE in the EP benchmark: run-time bench variant ``semmoe`` (``semmoe+bigmac``, ``semmoe+farskip``, ...).

The variant's ``bench_runtime`` hook (``tools/semmoe/variant_tools.py``) returns a :class:`SemMoEBench`;
the model worker (``tools.bench.variant_worker``) runs it. The benchmark trains with attention data-parallel over the EP ranks (TP=1, EP = world), so the
scheduling that applies is Algorithm 2 (requests -> DP ranks); every training sample is a request.
:class:`SemMoEBench` adds two things to the model worker's run, nothing else changes:

1. ``place(model)`` (the ``before_wrap`` hook: the bare model, before DDP and the optimizer copy
   it): run the freshly initialised model (the same seed as every variant) forward on
   ``profile_samples`` samples of the validation split (documents the training steps never read,
   as the paper profiles on a separate 20% of the requests), record every router's top-k, solve
   Algorithm 1 for D = EP on rank 0,
   broadcast the tables, and permute experts and router rows so that rank d owns device d's
   experts (:func:`placement.permute_model_experts`; the model computes the same function).
2. ``schedule(data_iterator, num_micro)`` before each step: the step's global batch (every rank's
   micro-batches, all-gathered over the DP group; samples are a few hundred token ids) is
   re-assigned to ranks by Algorithm 2 in global sample order; the rotating mask gives every rank
   exactly its usual number of samples, which it regroups into micro-batches. The global batch is
   ``standard``'s, so with an all-ones loss mask the gradient is the same up to summation order;
   only the MoE auxiliary loss, computed per rank and micro-batch, sees other groupings.

The all-to-all volume then falls by the share of activations that became local; the dispatchers'
counters measure it. Token re-batching (Algorithm 3) needs attention-TP and is measured by
``python -m tools.semmoe lar --mode tp`` instead.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from megatron.common import collectives
from tools.variants import BenchRuntime

__all__ = ["SemMoEBench", "VARIANT", "DEFAULT_PROFILE_SAMPLES", "from_context"]

VARIANT = "semmoe"
DEFAULT_PROFILE_SAMPLES = 256


class SemMoEBench(BenchRuntime):
    """Placement and per-step request scheduling for one benchmark run (see the module docstring).

    ``configs``: the worker's :class:`Configs`; ``tokenizer``: its tokenizer; ``pg_collection``:
    the layout's groups; ``profile_dataset``: samples to profile on (the validation split), of
    which the first ``profile_samples`` are used.
    """

    def __init__(self, configs, tokenizer, pg_collection, profile_dataset,
                 profile_samples: int = DEFAULT_PROFILE_SAMPLES, seed: int = 0):  # fmt: skip
        from megatron.core import parallel_state

        tp = configs.parallel.tensor_model_parallel_size
        pp = configs.parallel.pipeline_model_parallel_size
        ep = configs.parallel.expert_model_parallel_size
        world = dist.get_world_size()
        if tp != 1 or pp != 1 or ep != world:
            raise ValueError(
                f"variant {VARIANT} schedules requests over attention-DP ranks: it needs TP=1, PP=1 and EP = "
                f"the number of ranks (got TP={tp}, PP={pp}, EP={ep}, {world} ranks)"
            )
        if profile_samples < 1:
            raise ValueError(f"{VARIANT}: profile_samples must be >= 1, got {profile_samples}")
        if profile_dataset is None or len(profile_dataset) < profile_samples:
            have = 0 if profile_dataset is None else len(profile_dataset)
            raise ValueError(
                f"{VARIANT}: the validation split has {have} samples, fewer than the {profile_samples} to profile "
                "on (give --split a non-zero validation part, or lower --semmoe-profile-samples)"
            )
        self.configs = configs
        self.vocab_size = int(tokenizer.vocab_size)
        self.pg_collection = pg_collection
        self.dataset = profile_dataset
        self.profile_indices = range(profile_samples)
        self.seed = seed
        self.rank = dist.get_rank(pg_collection.ep)
        self.world = world
        self.dp_group = parallel_state.get_data_parallel_group()
        assert dist.get_world_size(self.dp_group) == world and dist.get_rank(self.dp_group) == self.rank
        self.tables = None
        self.scheduler = None
        self._info: dict = {}

    schedules = True

    @property
    def info(self) -> dict:
        """Profile, solve and permute figures of the placement (empty before ``place``)."""
        return self._info

    # ----------------------------------------------------------------------------- placement

    def _profile(self, model):
        from moe_variants.common.routing import RouteRecorder

        from moe_variants.semmoe.placement import gather_embedding
        from moe_variants.semmoe.profile import extend_vocabulary, profile_from_traces

        mbs = self.configs.training.micro_batch_size
        mine = list(self.profile_indices)[self.rank :: self.world]
        steps = -(-len(self.profile_indices) // (self.world * mbs))  # every rank runs as many forwards
        recorder = RouteRecorder(model)
        traces = []
        was_training = model.training
        model.eval()  # no auxiliary-loss bookkeeping; dropout is off in these configs anyway
        try:
            with torch.no_grad(), recorder:
                for step in range(steps):
                    chunk = mine[step * mbs : (step + 1) * mbs]
                    samples = [self.dataset[i] for i in chunk] or [self.dataset[self.profile_indices[0]]]
                    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
                    _forward(model, tokens)
                    topk = torch.stack(recorder.take())  # [L, S*B, K] in megatron's [s, b] order
                    seq, b = tokens.shape[1], tokens.shape[0]
                    topk = topk.view(topk.shape[0], seq, b, -1)
                    for j in range(len(chunk)):
                        traces.append((tokens[j].numpy(), topk[:, :, j, :].numpy().astype(np.int32)))
        finally:
            model.train(was_training)
        gathered = [None] * self.world if self.rank == 0 else None
        collectives.gather_object(traces, gathered, dst=0)
        embedding = gather_embedding(model, self.pg_collection, self.vocab_size)
        if self.rank != 0:
            return None
        all_traces = [t for part in gathered for t in part]
        profile = profile_from_traces(all_traces, self.vocab_size, recorder.num_experts)
        return extend_vocabulary(profile, embedding)

    def place(self, model) -> None:
        """Profile, solve and permute (collective; the ``before_wrap`` hook)."""
        from moe_variants.semmoe.metrics import evaluate
        from moe_variants.semmoe.methods import place
        from moe_variants.semmoe.placement import permute_model_experts

        t0 = time.perf_counter()
        profile = self._profile(model)
        t1 = time.perf_counter()
        payload = [None]
        if self.rank == 0:
            tables = place(VARIANT, profile, self.world, seed=self.seed)
            predicted = evaluate(tables, profile, "dp", int(self.configs.model.hidden_size), 4, 0)
            payload = [(tables, {"profile_tokens": profile.num_tokens, "profile_requests": profile.num_requests,
                                 "predicted_dp_lar_on_profile": predicted.lar,
                                 "imbalance_mean": predicted.imbalance_mean})]  # fmt: skip
        collectives.broadcast_object_list(payload, src=0)
        self.tables, info = payload[0]
        t2 = time.perf_counter()
        permute_model_experts(model, self.pg_collection, self.tables.physical_to_logical())
        from moe_variants.semmoe.scheduling import DPRequestScheduler

        self.scheduler = DPRequestScheduler(self.tables)
        self._info = dict(info, profile_s=t1 - t0, solve_s=t2 - t1, permute_s=time.perf_counter() - t2,
                         profile_samples=len(self.profile_indices))  # fmt: skip

    # ---------------------------------------------------------------------------- scheduling

    def schedule(self, data_iterator: Iterator[dict], num_microbatches: int) -> Iterator[dict]:
        """This rank's micro-batches of the next step after Algorithm 2 re-assigned the global batch."""
        if self.scheduler is None:
            raise RuntimeError("place() must run before schedule()")
        local = [next(data_iterator) for _ in range(num_microbatches)]
        keys = sorted(local[0])
        for k in keys:
            if not torch.is_tensor(local[0][k]):
                raise ValueError(f"{VARIANT}: batch entry {k!r} is not a tensor; cannot re-schedule it")
        mbs = local[0][keys[0]].shape[0]
        # [world, num_micro, mbs, ...] -> global sample order (micro-batch j, rank r, row i), the
        # order the sampler hands samples out in
        gathered = {}
        for k in keys:
            mine = torch.stack([m[k] for m in local]).contiguous()
            # gloo gathers neither bool nor int16 (the blended dataset's dataset_id): integers travel as int64
            wire = mine if mine.is_floating_point() or mine.dtype == torch.int64 else mine.to(torch.int64)
            parts = [torch.empty_like(wire) for _ in range(self.world)]
            collectives.all_gather(parts, wire, group=self.dp_group)
            stacked = torch.stack(parts).to(mine.dtype)  # [world, num_micro, mbs, ...]
            gathered[k] = stacked.transpose(0, 1).reshape(self.world * num_microbatches * mbs, *mine.shape[2:])
        tokens = gathered["tokens"].numpy()
        ranks = np.array([self.scheduler.assign(t) for t in tokens])
        chosen = torch.from_numpy(np.flatnonzero(ranks == self.rank))
        assert chosen.numel() == num_microbatches * mbs, "the rotating mask balances whole rounds of D samples"
        return iter([{k: gathered[k].index_select(0, chosen[j * mbs : (j + 1) * mbs]) for k in keys}
                     for j in range(num_microbatches)])  # fmt: skip


def _forward(model, tokens: torch.Tensor):
    from moe_variants.builder import causal_attention_mask

    seq = tokens.shape[1]
    positions = torch.arange(seq)[None].expand_as(tokens)
    return model(tokens, positions, causal_attention_mask(seq))


def from_context(context) -> SemMoEBench:
    """The bench variant's set-up for one model-worker run (``tools.variants.BenchContext``): the spec's
    options ``semmoe_profile_samples`` and ``semmoe_seed``, profiling on that many samples of the
    run's validation split."""
    samples = int(context.options.get("semmoe_profile_samples", DEFAULT_PROFILE_SAMPLES))
    dataset = context.validation_split(samples) if samples >= 1 else None
    return SemMoEBench(context.configs, context.tokenizer, context.pg_collection, dataset, samples,
                       seed=int(context.options.get("semmoe_seed", 0)))
