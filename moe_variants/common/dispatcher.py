"""megatron-core token dispatchers with the project's counted, device-generic collectives.

``AlltoAllDispatcher`` keeps all of ``MoEAlltoAllTokenDispatcher``'s permutation logic and
replaces only its two communication steps: megatron-core's ``_AllToAll`` allocates its output on
``torch.cuda.current_device()`` (``tensor_parallel/mappings.py:442``) and is always blocking; ours
allocates on the input's device, counts bytes and time, and can run asynchronously (FarSkip).
``AllGatherDispatcher`` wraps the all-gather / reduce-scatter steps of
``MoEAllGatherTokenDispatcher`` with the same accounting. ``ReplicatedDispatcher`` is the serving
layout of vLLM and SGLang (FarSkip paper §4.2): every rank already holds all tokens, so there is no
dispatch, and one all-reduce sums the local experts' outputs.

Both expose ``self.comm`` (a ``CommCounters``), which the training loop and the EP benchmark sum
over layers.

In dropless routing (every token goes to exactly ``topk`` experts: no capacity factor, no padding
for quantization) ``AlltoAllDispatcher`` permutes without a host sync: megatron-core's unfused
``permute`` selects with ``masked_select`` (an output of data-dependent size: two device-to-host
syncs per layer), ours sorts the routed copies by expert (``sort_tokens_by_expert``: a top-k, a
stable sort and an ``index_select``, the same order), and at EP = 1 with no expert-TP it keeps
``tokens_per_expert`` on the device and skips the per-expert chunk sort, an identity with one
chunk per expert (upstream copies the counts to the host and waits for them there). With
``GroupedExperts`` an EP = 1 MoE layer then runs without a host sync (``tests/experts``).

Shape legend: T tokens, E experts, K top-k, N = T x K routed copies.
"""

from __future__ import annotations

import torch
from megatron.compat.token_dispatcher import AlltoAllTokenDispatcher
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from moe_variants.common import timing
from moe_variants.common.comm import CommCounters, all_to_all, start_all_reduce

__all__ = ["AlltoAllDispatcher", "AllGatherDispatcher", "ReplicatedDispatcher", "build_token_dispatcher",
           "host_splits", "sort_tokens_by_expert", "use_replicated_experts"]


def host_splits(splits) -> list[int]:
    """Split sizes as python ints (numpy array, CPU/GPU tensor or list in, list out)."""
    if torch.is_tensor(splits):
        return [int(n) for n in splits.tolist()]
    return [int(n) for n in splits]


def sort_tokens_by_expert(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """Dropless permutation order without a host sync.

    routing_map: [T, E] bool with exactly ``topk`` experts per token; probs: [T, E].
    Returns (token_index [N] int64, permuted_probs [N]), N = T x topk: the source token of each
    routed copy, grouped by expert in expert order and by token within an expert (the order of
    megatron-core's ``permute``), and its probability (differentiable in ``probs``).
    """
    experts = torch.topk(routing_map.to(torch.int8), topk, dim=1, sorted=False).indices  # [T, K]
    order = torch.argsort(experts.reshape(-1), stable=True)  # entry t*K + k: expert-major, t ascending
    return order // topk, probs.gather(1, experts).reshape(-1)[order]


class AlltoAllDispatcher(AlltoAllTokenDispatcher):
    """All-to-all dispatcher whose EP collectives go through ``moe_variants.common.comm`` (upstream's
    ``MoEAlltoAllTokenDispatcher`` through ``megatron.compat.token_dispatcher``, which keeps the
    split sizes on the host on the CPU), and whose dropless permutation needs no host sync (module
    docstring)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection=pg_collection)
        self.comm = CommCounters()
        # dropless: the routed copies are T x K, known without reading the routing map
        self.sorted_permutation = not (
            self.drop_and_pad or config.moe_expert_capacity_factor is not None
            or config.moe_router_padding_for_quantization or config.moe_permute_fusion
        )
        # one rank, one expert-TP rank: each expert's tokens form one chunk, in expert order
        self.single_chunk = self.sorted_permutation and self.ep_size * self.tp_size == 1

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Upstream's step (metadata, split sizes to the host where EP or expert-TP needs them, then
        permutation 1) with the sorted permutation in dropless routing."""
        if not self.sorted_permutation:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        assert self.shared_experts is None  # ProjectMoELayer refuses the shared-expert overlap
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if not self.single_chunk:
            self.tokens_per_expert = self.synchronize_splits("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        token_index, permuted_probs = sort_tokens_by_expert(routing_map, probs, self.config.moe_router_topk)
        self.reversed_local_input_permutation_mapping = token_index
        return hidden_states.index_select(0, token_index), permuted_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self.single_chunk:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None  # on the device
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self.single_chunk:
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def dispatch_splits(self) -> tuple[list[int], list[int]]:
        """(output_splits, input_splits) of the dispatch all-to-all, as host ints."""
        return host_splits(self.output_splits), host_splits(self.input_splits)

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        self.tokens_per_expert = self.synchronize_splits(
            "before_ep_alltoall", self.tokens_per_expert
        )
        if self.ep_size == 1:
            return permutated_local_input_tokens, permuted_probs
        out_splits, in_splits = self.dispatch_splits()
        tokens = all_to_all(
            self.ep_group, permutated_local_input_tokens, out_splits, in_splits,
            counters=self.comm, kind="dispatch",
        )
        probs = all_to_all(
            self.ep_group, permuted_probs, out_splits, in_splits, counters=self.comm, kind="meta"
        )
        return tokens, probs

    def token_dispatch_async(self, permutated_local_input_tokens, permuted_probs):
        """Start the dispatch all-to-alls without waiting.

        Returns ``(tokens, probs, wait)``: call ``wait()`` before reading ``tokens``/``probs``. The
        backward all-to-alls are asynchronous too and waited by hooks on the inputs (see
        ``comm.all_to_all``). EP=1 issues no collective.
        """
        self.tokens_per_expert = self.synchronize_splits(
            "before_ep_alltoall", self.tokens_per_expert
        )
        if self.ep_size == 1:
            return permutated_local_input_tokens, permuted_probs, _no_wait
        out_splits, in_splits = self.dispatch_splits()
        tokens, h_tokens = all_to_all(
            self.ep_group, permutated_local_input_tokens, out_splits, in_splits,
            counters=self.comm, kind="dispatch", async_op=True,
        )
        probs, h_probs = all_to_all(
            self.ep_group, permuted_probs, out_splits, in_splits, counters=self.comm, kind="meta",
            async_op=True,
        )
        return tokens, probs, _waiter(h_tokens, h_probs)

    def token_combine_async(self, hidden_states):
        """Start the combine all-to-all; returns ``(output, wait)`` like ``token_dispatch_async``."""
        if self.ep_size == 1:
            return hidden_states, _no_wait
        out_splits, in_splits = self.dispatch_splits()
        output, handles = all_to_all(
            self.ep_group, hidden_states, in_splits, out_splits, counters=self.comm, kind="combine",
            async_op=True,
        )
        return output, _waiter(handles)

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        if self.ep_size == 1:
            return hidden_states
        out_splits, in_splits = self.dispatch_splits()
        return all_to_all(
            self.ep_group, hidden_states, in_splits, out_splits, counters=self.comm, kind="combine"
        )


def _no_wait():
    pass


def _waiter(*handle_dicts):
    def wait():
        for handles in handle_dicts:
            handles["forward"].wait()

    return wait


class AllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """All-gather dispatcher with byte/time accounting of its TPxEP all-gather and reduce-scatter.

    Bytes are what leaves this rank: an all-gather sends the local rows to ``n-1`` peers and a
    reduce-scatter sends ``(n-1)/n`` of the gathered rows, i.e. the same ``local rows x (n-1)``.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection=pg_collection)
        self.comm = CommCounters()
        self._group_size = self.tp_size * self.ep_size

    def token_dispatch(self, hidden_states, probs):
        if self._group_size == 1:
            return super().token_dispatch(hidden_states, probs)
        peers = self._group_size - 1
        # blocking collectives: the compute stream (or thread) waits from start to done
        clock = timing.clock_for(hidden_states.device)
        start = clock.stamp()
        out_hidden, out_probs = super().token_dispatch(hidden_states, probs)
        done = clock.stamp()
        self.comm.add_bytes("dispatch", hidden_states.numel() * hidden_states.element_size() * peers)
        meta = probs.numel() * probs.element_size() + probs.numel()  # probs + bool routing map
        self.comm.add_bytes("meta", meta * peers)
        self.comm.add_span(False, start, done, start)
        return out_hidden, out_probs

    def token_combine(self, hidden_states):
        if self._group_size == 1:
            return super().token_combine(hidden_states)
        clock = timing.clock_for(hidden_states.device)
        start = clock.stamp()
        out = super().token_combine(hidden_states)
        done = clock.stamp()
        self.comm.add_bytes("combine", out.numel() * 4 * (self._group_size - 1))  # fp32 reduce
        self.comm.add_span(False, start, done, start)
        return out


class ReplicatedDispatcher(MoEAllGatherTokenDispatcher):
    """Experts over replicated activations (inference, vLLM's scheme; FarSkip paper §4.2).

    When every rank of the expert group (``tp_ep``: expert-TP x EP) already holds the same tokens,
    as with tensor-parallel attention and sequence parallelism off (``TP = EP x ETP`` on the same
    ranks), the all-gather dispatcher's gather would only copy what each rank has. Here there is no
    dispatch: each rank routes all tokens (the router is replicated, so the same decisions),
    runs its local experts on the tokens routed to them, scatters their weighted outputs back into
    a ``[T, h]`` partial sum (upstream's ``dispatch_postprocess`` / ``combine_preprocess``), and
    one all-reduce over the group adds the partials: ``token_combine``, or ``token_combine_async``
    for FarSkip, whose next layer's attention does not read it. Forward only.

    Bytes: a ring all-reduce sends ``2 (n-1)/n`` of the ``[T, h]`` partial from each rank, in the
    activations' dtype (the all-gather dispatcher's reduce-scatter runs in the probabilities'
    fp32; the summation order differs from the all-to-all path's, so logits agree to rounding).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection=pg_collection)
        self.comm = CommCounters()
        self._group_size = self.tp_size * self.ep_size

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs  # every rank holds every token already

    def token_dispatch_async(self, hidden_states, probs):
        return hidden_states, probs, _no_wait

    def token_combine(self, hidden_states):
        output, wait = self.token_combine_async(hidden_states)
        wait()
        return output

    def token_combine_async(self, hidden_states):
        """Start the all-reduce of the local experts' partial sum; returns ``(output, wait)``."""
        if self._group_size == 1:
            return hidden_states, _no_wait
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            raise ValueError("the replicated-activation expert layout is for inference (no gradients)")
        pending = start_all_reduce(self.tp_ep_group, hidden_states, self.comm, "combine")
        return pending.output, pending.wait


def use_replicated_experts(model, pg_collection) -> int:
    """Serve ``model``'s MoE layers with ``ReplicatedDispatcher`` (no parameters change). Needs the
    activations replicated over the expert group: tensor-parallel attention without sequence
    parallelism (``engine.replicate_activations``) on exactly the expert group's ranks. Returns
    the number of layers changed; raises a one-line ``ValueError`` on any other layout."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("--expert-comm allreduce: the model has no MoE layer")
    tp_ranks = dist.get_process_group_ranks(pg_collection.tp) if pg_collection.tp.size() > 1 else [dist.get_rank()]
    tp_ep_ranks = (dist.get_process_group_ranks(pg_collection.tp_ep) if pg_collection.tp_ep.size() > 1
                   else [dist.get_rank()])
    if sorted(tp_ranks) != sorted(tp_ep_ranks) or len(tp_ranks) == 1:
        raise ValueError(
            f"--expert-comm allreduce needs tensor-parallel attention over exactly the expert group "
            f"(--tensor-model-parallel-size = expert-parallel x expert-tensor-parallel size > 1); here "
            f"attention TP spans ranks {sorted(tp_ranks)} and the experts {sorted(tp_ep_ranks)}")
    for layer in layers:
        old = layer.token_dispatcher
        if type(old) not in (AlltoAllDispatcher, AllGatherDispatcher):
            raise ValueError(f"--expert-comm allreduce: MoE layer {layer.layer_number} has "
                             f"{type(old).__name__}, not the project's standard dispatcher "
                             "(a variant with its own dispatcher)")
        new = ReplicatedDispatcher(layer.num_local_experts, layer.local_expert_indices, layer.config,
                                   pg_collection=layer.pg_collection)
        new.comm = old.comm  # keep the counters (and any timeline) attached by the caller
        layer.token_dispatcher = new
    return len(layers)


def build_token_dispatcher(config, num_local_experts, local_expert_indices, pg_collection):
    """The project dispatcher for ``config.moe_token_dispatcher_type``."""
    kind = config.moe_token_dispatcher_type
    if kind == "alltoall":
        cls = AlltoAllDispatcher
    elif kind == "allgather":
        cls = AllGatherDispatcher
    else:
        raise ValueError(
            f"--moe-token-dispatcher-type {kind!r} is not supported (choose alltoall or allgather)"
        )
    return cls(num_local_experts, local_expert_indices, config, pg_collection=pg_collection)
