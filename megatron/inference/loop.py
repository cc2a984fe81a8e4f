"""The serving loop every rank runs: requests in, engine steps in lockstep, tokens out.

Each iteration, on every rank (the main thread, where the CPU device redirect is active):

1. every rank all-gathers a small fixed-size header (one float64 tensor): its outstanding work,
   the size of its pending token updates, its engine counters (``engine.STAT_FIELDS``, so
   ``/metrics`` is fresh without a message of its own) and, from rank 0, the size of its
   commands and the stop flag. A completed all-gather proves every rank arrived: it ticks the
   heartbeat the watchdog and ``/health`` read (``megatron.inference.watchdog``), and so do the
   start and the end of every engine step (a slow step is judged by how long steps take);
2. only when rank 0 has commands (new requests, cancellations) does it broadcast them (pickled);
   each new request goes to one data-parallel rank (``schedule``: round-robin like megatron-core's
   ``DataParallelInferenceCoordinator.get_next_data_parallel_rank``, or any ``f(prompt tokens,
   outstanding per rank) -> rank``, the hook for Sem-MoE's request scheduling); the
   tensor-parallel peers of that rank add it too;
3. only when some rank has token updates (or, with routing statistics, new per-device routing
   counts: at most once per ``stats_interval_s`` while busy, and once when it goes idle) are they
   gathered to rank 0, which publishes them to the frontend;
4. a rank with work steps its engine; a rank without work (or whose requests all wait for KV
   blocks) whose expert-parallel group has work runs the engine's dummy forward so that the
   all-to-alls of its peers line up (the rule of upstream's ``run_engine_with_coordinator``,
   ``dynamic_engine.py:1690-1710``). Every rank decides this from the same numbers (the headers
   plus the requests just assigned), so an expert-parallel group always runs the same number of
   forwards; when no rank has work, rank 0 waits for a request (``idle_wait_s``).

An idle iteration is one small all-gather; a decode step adds one gather of the token deltas.

A request that fails while it is added (or sampled: ``engine.RankEngine``) fails alone: its
failure travels to rank 0 as a ``TokenUpdate(failed=...)`` and every rank keeps serving. An
exception anywhere else (a step, a collective: a peer died) is an engine failure and propagates
(``serve.py`` fails every in-flight request and exits non-zero); a rank never skips a collective
its peers are waiting in.

Why not megatron-core's own transport (``DataParallelInferenceCoordinator`` + ``InferenceClient``
over ZMQ): in 0.16.1 an engine reports a request only when it has finished
(``async_bookkeep``'s ``ENGINE_REPLY``), so a client cannot stream tokens or measure time to
first token, and there is no message to cancel a request; its sockets bind to the host name's
address (``socket.gethostname()``), which ranks in separate network namespaces cannot reach.
The collectives here go over the job's own process group, wherever torchrun put the ranks.
"""

from __future__ import annotations

import itertools
import pickle
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.inference.engine import STAT_FIELDS, TokenUpdate
from megatron.common import collectives
from megatron.common.events import Event

__all__ = ["serve_loop", "round_robin", "HEADER_FIELDS", "STEP_END"]

# Emitted after every loop iteration that ran the engine (a step, a dummy forward) with their
# number so far on this rank; what subscribes from outside the loop (``tools.faults.rank``) runs
# there, and what it raises is an engine failure.
STEP_END = Event("serving engine step end")

HEADER_FIELDS = ("work", "updates_nbytes", "commands_nbytes", "stop") + STAT_FIELDS
_WORK, _UPDATES, _COMMANDS, _STOP = range(4)


def round_robin(num_ranks: int) -> Callable:
    """Upstream's coordinator policy: requests go to the data-parallel ranks in turn."""
    turn = itertools.cycle(range(num_ranks))
    return lambda prompt, outstanding: next(turn)


def _bytes_tensor(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _add(rank_engine, submit) -> Optional[TokenUpdate]:
    """Add one request; a failure fails that request only (its update is returned)."""
    try:
        rank_engine.add(submit.request_id, submit.prompt, max_tokens=submit.max_tokens, sampling=submit.sampling,
                        termination_id=-1 if submit.ignore_eos else rank_engine.controller.tokenizer.eod)
    except Exception as err:
        detail = traceback.format_exception_only(type(err), err)[-1].strip()
        return TokenUpdate(submit.request_id, [], finished=True, failed=f"the engine could not add the request: {detail}")
    return None


def serve_loop(rank_engine, pg_collection, *, frontend=None, schedule: Optional[Callable] = None,
               idle_wait_s: float = 0.02, on_iteration=None, heartbeat=None, stats_interval_s: float = 1.0) -> None:
    """Run until rank 0's frontend says stop and no rank has work (see the module docstring).

    ``frontend`` is rank 0's ``Frontend`` (None elsewhere). ``on_iteration(busy)`` is called on
    every rank after each iteration (the SIGTERM handler of rank 0 hooks in there);
    ``heartbeat.tick()`` after every completed header exchange and at the start and end of every
    engine step (real or dummy).
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
    matrices: list = [[] for _ in range(world)]  # rank 0: the last routing matrix of each rank
    pending: list = []
    matrix_due = time.monotonic() + stats_interval_s
    matrix_forwards = 0  # forwards counted when the routing counts were last sent
    steps = 0  # engine steps this loop ran (STEP_END)
    busy = False
    while True:
        commands = b""
        stop = False
        if rank == 0:
            cmds = frontend.take_commands(0.0 if busy else idle_wait_s)
            stop = cmds.stop
            if cmds.submits or cmds.cancels:
                placed = {}
                for submit in cmds.submits:
                    target = int(schedule(submit.prompt, list(outstanding)))
                    if not 0 <= target < dp_size:
                        raise ValueError(f"the request scheduler gave rank {target}, not in [0, {dp_size})")
                    owner[submit.request_id] = placed[submit.request_id] = target
                    outstanding[target] += 1
                frontend.assigned(placed)
                message = (cmds.submits, cmds.cancels, placed)
                commands = pickle.dumps(message)
        matrix = None
        forwards = rank_engine.steps + rank_engine.dummy_steps
        if rank_engine.activations is not None and forwards != matrix_forwards and (
                time.monotonic() >= matrix_due or not rank_engine.local_work()):  # due, or final while idle
            matrix, matrix_due = rank_engine.routing_matrix(), time.monotonic() + stats_interval_s
            matrix_forwards = forwards
        updates = pickle.dumps((pending, matrix)) if (pending or matrix is not None) else b""
        stats = rank_engine.stats()
        header = torch.tensor([rank_engine.local_work(), len(updates), len(commands), float(stop)]
                              + [float(stats[k]) for k in STAT_FIELDS], dtype=torch.float64)
        headers = [torch.empty_like(header) for _ in range(world)]
        collectives.all_gather(headers, header)
        if heartbeat is not None:
            heartbeat.tick()
        headers = torch.stack(headers)  # [world, HEADER_FIELDS]
        stop = bool(headers[0, _STOP])

        submits, cancels, assignment = [], [], {}
        size = int(headers[0, _COMMANDS])
        if size:
            data = collectives.broadcast(_bytes_tensor(commands, size), src=0)
            submits, cancels, assignment = pickle.loads(data.numpy().tobytes()) if rank else message

        published = []  # rank 0: every rank's updates since the last iteration
        size = int(headers[:, _UPDATES].max())
        if size:
            parts = [torch.empty(size, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
            collectives.gather(_bytes_tensor(updates, size), parts, dst=0)
            for r, part in enumerate(parts or []):
                n = int(headers[r, _UPDATES])
                if n:
                    ups, mat = pickle.loads(part[:n].numpy().tobytes())
                    published.extend(ups)
                    if mat is not None:
                        matrices[r] = mat
        pending = []

        for submit in submits:
            if assignment[submit.request_id] == dp_rank:
                failure = _add(rank_engine, submit)
                if failure is not None and reports:
                    pending.append(failure)
        for rid in cancels:
            update = rank_engine.cancel(rid)
            if update is not None and reports:
                pending.append(update)
        if rank == 0:
            for u in published:
                if u.finished and u.request_id in owner:
                    outstanding[owner.pop(u.request_id)] -= 1
            rank_stats = [dict(zip(STAT_FIELDS, row[len(HEADER_FIELDS) - len(STAT_FIELDS):].tolist()))
                          for row in headers]
            for r, s in enumerate(rank_stats):
                s["activations_to_device"] = matrices[r]
            frontend.publish(published, rank_stats)

        # the same numbers on every rank: work before this iteration plus the requests just assigned
        expected = headers[:, _WORK].clone()
        for submit in submits:
            target = assignment[submit.request_id]
            for r in range(world):
                if dp_of_rank[r] == target:
                    expected[r] += 1
        group_work = float(expected[ep_ranks].max())
        busy = float(expected.max()) > 0
        if not busy and stop:
            break
        work = rank_engine.local_work()
        if work or group_work:
            if heartbeat is not None:
                heartbeat.tick()
            if work:
                updates_now, forwarded = rank_engine.step()
                if reports:
                    pending.extend(updates_now)
                if not forwarded and group_work:
                    rank_engine.dummy_step()
            else:
                rank_engine.dummy_step()
            if heartbeat is not None:
                heartbeat.tick()
            steps += 1
            STEP_END.emit(steps)
        if on_iteration is not None:
            on_iteration(busy)
