"""The serving loop every rank runs: requests in, engine steps in lockstep, tokens out.

Each iteration, on every rank (the main thread, where the CPU device redirect is active):

1. every rank all-gathers a small fixed-size header (one float64 tensor): its outstanding work,
   the size of its pending token updates, its engine counters (``engine.STAT_FIELDS``, so
   ``/metrics`` is fresh without a message of its own), its request-set digest and count of
   failures its TP peers have not agreed on yet (below) and, from rank 0, the size of its
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

A request that fails while it is scheduled (rank 0's ``schedule`` raised on it), added or
sampled (``engine.RankEngine``) fails alone: its failure travels to rank 0 as a
``TokenUpdate(failed=...)`` (one line, the client's 500) and every rank keeps serving; the
traceback goes to the failing rank's stderr (``engine.request_failure``). The tensor-parallel
peers of a rank hold the same requests and run the same steps, so a request failure is their
agreement, never one rank's: a failed add is agreed before the step that would batch the request (one all-gather of a
flag per new request over the TP group, only in iterations that bring it new requests), a failed
sample at the next iteration (the header carries each rank's count of failures not yet agreed; a
TP group with some exchanges their ids); every peer drops the request and the lowest TP rank
that saw it fail reports it. Each header also carries a digest of the rank's request set (ids,
prompt, generated and still-to-prefill lengths: what its next step batches), so every rank sees
at once when the peers of a TP group hold different requests and raises ``EngineDiverged`` (one
line naming the ranks) instead of running a step whose collectives would hang or mix other
tokens. An exception anywhere else (a step, a collective: a peer died) is an engine failure and
propagates (``serve.py`` fails every in-flight request and exits non-zero); a rank never skips a
collective its peers are waiting in.

Why not megatron-core's own transport (``DataParallelInferenceCoordinator`` + ``InferenceClient``
over ZMQ): in 0.16.1 an engine reports a request only when it has finished
(``async_bookkeep``'s ``ENGINE_REPLY``), so a client cannot stream tokens or measure time to
first token, and there is no message to cancel a request; its sockets bind to the host name's
address (``socket.gethostname()``), which ranks in separate network namespaces cannot reach.
The collectives here go over the job's own process group, wherever torchrun put the ranks.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.inference.engine import STAT_FIELDS, TokenUpdate, request_failure
from megatron.common import collectives
from megatron.common.events import Event

__all__ = ["serve_loop", "round_robin", "request_digest", "EngineDiverged", "HEADER_FIELDS", "STEP_END"]

# Emitted after every loop iteration that ran the engine (a step, a dummy forward) with their
# number so far on this rank; what subscribes from outside the loop (``tools.faults.rank``) runs
# there, and what it raises is an engine failure.
STEP_END = Event("serving engine step end")

HEADER_FIELDS = ("work", "updates_nbytes", "commands_nbytes", "stop", "failures", "digest") + STAT_FIELDS
_WORK, _UPDATES, _COMMANDS, _STOP, _FAILURES, _DIGEST = range(6)
_REQUESTS = [HEADER_FIELDS.index(f) for f in ("requests_active", "requests_waiting")]


class EngineDiverged(RuntimeError):
    """The ranks of a tensor-parallel group hold different requests: an engine failure."""


LOOP_PHASES = ("work", "header", "broadcast", "gather", "adds", "step")


def iteration_record(marks: list, arrived: int, gathered: bool, stepped: bool) -> dict:
    """One iteration's phases (``serve_loop(trace=...)``, ``serve --a2a-spans``): ``t`` its start,
    ``phases`` the seconds of each of ``LOOP_PHASES`` (the loop's own work before the header
    exchange: commands, pickling, stats; the header's all-gather, with the wait for the slowest
    rank; the commands' broadcast; the token updates' gather; adding the new requests and
    publishing; the engine step or dummy forward, if any), ``arrived`` the requests the iteration
    brought, ``gathered`` whether it gathered token updates, ``stepped`` whether it stepped."""
    return {"t": marks[0], "phases": dict(zip(LOOP_PHASES, (b - a for a, b in zip(marks, marks[1:])))),
            "arrived": arrived, "gathered": gathered, "stepped": stepped}


def _mark(marks: Optional[list]) -> None:
    if marks is not None:
        marks.append(time.perf_counter())


def request_digest(lengths: dict) -> int:
    """A 48-bit digest (exact in a float64 header field) of a request set ``{request id: (lengths,
    ...)}`` (``RankEngine.request_lengths``)."""
    data = ";".join(f"{rid}:{','.join(map(str, lengths[rid]))}" for rid in sorted(lengths)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=6).digest(), "big")


def round_robin(num_ranks: int) -> Callable:
    """Upstream's coordinator policy: requests go to the data-parallel ranks in turn."""
    turn = itertools.cycle(range(num_ranks))
    return lambda prompt, outstanding: next(turn)


def _bytes_tensor(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _place(schedule, submit, outstanding: list, dp_size: int):
    """Rank 0: the data-parallel rank ``schedule`` gives a new request, or its failed update (a
    scheduler that raises or answers out of range fails that request only: a 500)."""
    try:
        target = int(schedule(submit.prompt, list(outstanding)))
        if not 0 <= target < dp_size:
            raise ValueError(f"it gave rank {target}, not in [0, {dp_size})")
    except Exception as err:
        return TokenUpdate(submit.request_id, [], finished=True,
                           failed=request_failure("the request scheduler failed on the request", err))
    return target


def _add(rank_engine, submit, rank: int) -> Optional[TokenUpdate]:
    """Add one request; a failure fails that request only (its update is returned)."""
    try:
        rank_engine.add(submit.request_id, submit.prompt, max_tokens=submit.max_tokens, sampling=submit.sampling,
                        termination_id=-1 if submit.ignore_eos else rank_engine.controller.tokenizer.eod)
    except Exception as err:
        return TokenUpdate(submit.request_id, [], finished=True,
                           failed=request_failure(f"the engine could not add the request on rank {rank}", err))
    return None


def _check_tp_groups(headers: torch.Tensor, tp_groups: list, step: int) -> None:
    """Raise ``EngineDiverged`` when the ranks of a tensor-parallel group sent different request
    digests (every rank checks every group: all of them stop at once)."""
    for group in tp_groups:
        digests = headers[list(group), _DIGEST]
        if bool((digests != digests[0]).any()):
            held = "; ".join(f"rank {r}: {int(headers[r, _REQUESTS].sum())} requests, digest "
                             f"{int(headers[r, _DIGEST]):012x}" for r in group)
            raise EngineDiverged(f"the tensor-parallel ranks {', '.join(map(str, group))} hold different requests "
                                 f"before engine step {step + 1} ({held})")


def _agree_adds(rank_engine, mine: list, failures: dict, tp, tp_rank: int, tp_size: int) -> list:
    """The TP group's agreement on the requests just added (``mine``, the same list on every
    peer) that failed on some peer (``failures``: this rank's): every peer drops them (still
    waiting: at once); the lowest peer that failed one returns its update."""
    if tp_size == 1 or not mine:
        return list(failures.values())
    flags = torch.tensor([s.request_id in failures for s in mine], dtype=torch.uint8)
    parts = [torch.empty_like(flags) for _ in range(tp_size)]
    collectives.all_gather(parts, flags, group=tp)
    reported = []
    for i, submit in enumerate(mine):
        failed_on = [r for r in range(tp_size) if parts[r][i]]
        if not failed_on:
            continue
        if submit.request_id not in failures:
            rank_engine.fail(submit.request_id)
        elif tp_rank == failed_on[0]:
            reported.append(failures[submit.request_id])
    return reported


def _agree_failures(rank_engine, unagreed: dict, tp, tp_rank: int, tp_size: int) -> list:
    """The TP group's agreement on the requests some peer failed in a step (``unagreed``: this
    rank's): every peer drops them; the lowest peer that failed one returns its update."""
    failed_by = [None] * tp_size
    collectives.all_gather_object(failed_by, sorted(unagreed), group=tp)
    reported = []
    for rid in sorted(set().union(*failed_by)):
        if rid not in unagreed:
            rank_engine.fail(rid)
        elif tp_rank == next(r for r in range(tp_size) if rid in failed_by[r]):
            reported.append(unagreed[rid])
    return reported


def serve_loop(rank_engine, pg_collection, *, frontend=None, schedule: Optional[Callable] = None,
               idle_wait_s: float = 0.02, on_iteration=None, heartbeat=None, stats_interval_s: float = 1.0,
               trace=None) -> None:
    """Run until rank 0's frontend says stop and no rank has work (see the module docstring).

    ``frontend`` is rank 0's ``Frontend`` (or its link to one in another process; None
    elsewhere). ``on_iteration(busy)`` is called on every rank after each iteration (the SIGTERM
    handler of rank 0 hooks in there); ``heartbeat.tick()`` after every completed header exchange
    and at the start and end of every engine step (real or dummy). ``trace(record)``, if given, gets
    every iteration's phases (``iteration_record``: what the loop's exchange between steps costs).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = dist.get_rank(pg_collection.dp), dist.get_world_size(pg_collection.dp)
    tp = pg_collection.tp
    tp_rank, tp_size = dist.get_rank(tp), dist.get_world_size(tp)
    reports = tp_rank == 0  # TP peers hold the same requests: one reports their tokens
    ep_ranks = dist.get_process_group_ranks(pg_collection.ep)
    layout = [None] * world
    collectives.all_gather_object(layout, (dp_rank, tuple(dist.get_process_group_ranks(tp))))
    dp_of_rank = [d for d, _ in layout]
    tp_groups = sorted({group for _, group in layout if len(group) > 1})
    my_tp = list(dist.get_process_group_ranks(tp))
    schedule = schedule or round_robin(dp_size)
    outstanding = [0] * dp_size  # rank 0's view: requests on each data-parallel rank
    owner: dict = {}
    matrices: list = [[] for _ in range(world)]  # rank 0: the last routing matrix of each rank
    pending: list = []
    unagreed: dict = {}  # request id -> this rank's failed update of a step, not yet agreed with its TP peers
    matrix_due = time.monotonic() + stats_interval_s
    matrix_forwards = 0  # forwards counted when the routing counts were last sent
    steps = 0  # engine steps this loop ran (STEP_END)
    busy = False
    while True:
        marks = [time.perf_counter()] if trace is not None else None
        commands = b""
        stop = False
        unplaced = []  # rank 0: requests the scheduler failed on
        if rank == 0:
            cmds = frontend.take_commands(0.0 if busy else idle_wait_s)
            stop = cmds.stop
            if cmds.submits or cmds.cancels:
                placed, placed_submits = {}, []
                for submit in cmds.submits:
                    target = _place(schedule, submit, outstanding, dp_size)
                    if isinstance(target, TokenUpdate):
                        unplaced.append(target)
                        continue
                    owner[submit.request_id] = placed[submit.request_id] = target
                    outstanding[target] += 1
                    placed_submits.append(submit)
                frontend.assigned(placed)
                message = (placed_submits, cmds.cancels, placed)
                commands = pickle.dumps(message)
        matrix = None
        forwards = rank_engine.steps + rank_engine.dummy_steps
        if rank_engine.activations is not None and forwards != matrix_forwards and (
                time.monotonic() >= matrix_due or not rank_engine.local_work()):  # due, or final while idle
            matrix, matrix_due = rank_engine.routing_matrix(), time.monotonic() + stats_interval_s
            matrix_forwards = forwards
        updates = pickle.dumps((pending, matrix)) if (pending or matrix is not None) else b""
        stats = rank_engine.stats()
        digest = request_digest(rank_engine.request_lengths()) if tp_size > 1 else 0
        header = torch.tensor([rank_engine.local_work(), len(updates), len(commands), float(stop), len(unagreed),
                               digest] + [float(stats[k]) for k in STAT_FIELDS], dtype=torch.float64)
        headers = [torch.empty_like(header) for _ in range(world)]
        _mark(marks)
        collectives.all_gather(headers, header)
        _mark(marks)
        if heartbeat is not None:
            heartbeat.tick(record=busy)  # after an idle iteration the interval waited for work
        headers = torch.stack(headers)  # [world, HEADER_FIELDS]
        stop = bool(headers[0, _STOP])
        _check_tp_groups(headers, tp_groups, steps)

        submits, cancels, assignment = [], [], {}
        size = int(headers[0, _COMMANDS])
        if size:
            data = collectives.broadcast(_bytes_tensor(commands, size), src=0)
            submits, cancels, assignment = pickle.loads(data.numpy().tobytes()) if rank else message

        _mark(marks)
        published = unplaced  # rank 0: every rank's updates since the last iteration
        gathered = size = int(headers[:, _UPDATES].max())
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
        _mark(marks)
        pending = []
        if tp_size > 1 and bool(headers[my_tp, _FAILURES].any()):
            pending.extend(_agree_failures(rank_engine, unagreed, tp, tp_rank, tp_size))
            unagreed = {}

        mine = [s for s in submits if assignment[s.request_id] == dp_rank]
        failures = {}
        for submit in mine:
            failure = _add(rank_engine, submit, rank)
            if failure is not None:
                failures[submit.request_id] = failure
        pending.extend(_agree_adds(rank_engine, mine, failures, tp, tp_rank, tp_size))
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

        _mark(marks)
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
        stepped = bool(work or group_work)
        if stepped:
            if heartbeat is not None:
                heartbeat.tick()
            if work:
                updates_now, forwarded = rank_engine.step()
                for u in updates_now:
                    if u.failed and tp_size > 1:
                        unagreed[u.request_id] = u
                    elif reports:
                        pending.append(u)
                if not forwarded and group_work:
                    rank_engine.dummy_step()
            else:
                rank_engine.dummy_step()
            if heartbeat is not None:
                heartbeat.tick()
            steps += 1
            STEP_END.emit(steps)
        if marks is not None:
            marks.append(time.perf_counter())
            trace(iteration_record(marks, len(submits), bool(gathered), stepped))
        if on_iteration is not None:
            on_iteration(busy)
