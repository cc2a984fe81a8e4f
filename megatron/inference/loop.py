"""The serving loop every rank runs: requests in, engine steps in lockstep, tokens out.

Each iteration, on every rank (the main thread, where the CPU device redirect is active):

1. rank 0 takes the frontend's queued commands (new requests, cancellations, stop) and
   broadcasts them; each new request goes to one data-parallel rank (``schedule``: round-robin
   like megatron-core's ``DataParallelInferenceCoordinator.get_next_data_parallel_rank``, or any
   ``f(prompt tokens, outstanding per rank) -> rank``, the hook for Sem-MoE's request
   scheduling); the tensor-parallel peers of that rank add it too;
2. every rank all-gathers ``(local work, token updates of its last step, engine stats)``; rank 0
   publishes the updates and stats to the frontend;
3. a rank with work steps its engine; a rank without work whose expert-parallel group has work
   runs the engine's dummy forward so that the all-to-alls of its peers line up (the rule of
   upstream's ``run_engine_with_coordinator``, ``dynamic_engine.py:1690-1710``); when no rank has
   work, rank 0 waits for a request (``idle_wait_s``) before the next broadcast.

Why not megatron-core's own transport (``DataParallelInferenceCoordinator`` + ``InferenceClient``
over ZMQ): in 0.16.1 an engine reports a request only when it has finished
(``async_bookkeep``'s ``ENGINE_REPLY``), so a client cannot stream tokens or measure time to
first token, and there is no message to cancel a request; its sockets bind to the host name's
address (``socket.gethostname()``), which ranks in separate network namespaces cannot reach.
The collectives here go over the job's own process group, wherever torchrun put the ranks.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch.distributed as dist

from moe_variants.common import collectives

__all__ = ["serve_loop", "round_robin"]


def round_robin(num_ranks: int) -> Callable:
    """Upstream's coordinator policy: requests go to the data-parallel ranks in turn."""
    turn = itertools.cycle(range(num_ranks))
    return lambda prompt, outstanding: next(turn)


def serve_loop(rank_engine, pg_collection, *, frontend=None, schedule: Optional[Callable] = None,
               idle_wait_s: float = 0.02, on_iteration=None) -> None:
    """Run until rank 0's frontend says stop and no rank has work (see the module docstring).

    ``frontend`` is rank 0's ``Frontend`` (None elsewhere). ``on_iteration(busy)`` is called on
    every rank after each iteration (the SIGTERM handler of rank 0 hooks in there).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = dist.get_rank(pg_collection.dp), dist.get_world_size(pg_collection.dp)
    reports = dist.get_rank(pg_collection.tp) == 0  # TP peers hold the same requests: one reports
    ep_ranks = dist.get_process_group_ranks(pg_collection.ep)
    dp_of_rank = [None] * world
    collectives.all_gather_object(dp_of_rank, dp_rank)
    schedule = schedule or round_robin(dp_size)
    outstanding = [0] * dp_size  # rank 0's view: requests on each data-parallel rank
    owner: dict = {}
    pending: list = []
    busy = False
    while True:
        cmds = frontend.take_commands(0.0 if busy else idle_wait_s) if rank == 0 else None
        box = [None]
        if rank == 0:
            for submit in cmds.submits:
                target = int(schedule(submit.prompt, list(outstanding)))
                if not 0 <= target < dp_size:
                    raise ValueError(f"the request scheduler gave rank {target}, not in [0, {dp_size})")
                owner[submit.request_id] = target
                outstanding[target] += 1
            box = [(cmds, {s.request_id: owner[s.request_id] for s in cmds.submits})]
        collectives.broadcast_object_list(box, src=0)
        cmds, assignment = box[0]
        for submit in cmds.submits:
            if assignment[submit.request_id] == dp_rank:
                rank_engine.add(submit.request_id, submit.prompt, max_tokens=submit.max_tokens,
                                temperature=submit.temperature, top_p=submit.top_p, top_k=submit.top_k,
                                termination_id=-1 if submit.ignore_eos else rank_engine.controller.tokenizer.eod,
                                seed=submit.seed)
        for rid in cmds.cancels:
            update = rank_engine.cancel(rid)
            if update is not None and reports:
                pending.append(update)
        work = rank_engine.local_work()
        gathered = [None] * world
        collectives.all_gather_object(gathered, (work, pending if reports else [], rank_engine.stats()))
        pending = []
        if rank == 0:
            updates = [u for _, ups, _ in gathered for u in ups]
            for u in updates:
                if u.finished and u.request_id in owner:
                    outstanding[owner.pop(u.request_id)] -= 1
            frontend.publish(updates, [s for _, _, s in gathered])
        group_work = max(gathered[r][0] for r in ep_ranks)
        any_work = max(g[0] for g in gathered)
        busy = any_work > 0
        if not busy and cmds.stop:
            break
        if work:
            pending = rank_engine.step()
        elif group_work:
            rank_engine.dummy_step()
        if on_iteration is not None:
            on_iteration(busy)
