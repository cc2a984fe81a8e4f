"""Serve a checkpoint of this project with an OpenAI-compatible HTTP API.

    python -m megatron.inference.serve --nproc-per-node 2 [--max-restarts 3] --load CKPT \\
        --expert-model-parallel-size 2 [--tensor-model-parallel-size 1] [--host 127.0.0.1] [--port 8000]

runs the HTTP front end in this process and the engine's ranks under torchrun, started as its child
(``megatron.inference.launcher``; the two talk over a Unix socket, ``megatron.inference.link``): a
stopped or dead rank 0 is answered for at once, and after torchrun restarts the ranks the same
front end serves again on the same port. ``torchrun --nproc_per_node=2 -m
megatron.inference.serve ...`` and ``python -m megatron.inference.serve --load CKPT`` (a world of one
rank) run the front end inside rank 0 (``megatron.inference.frontend``), as before.

Every rank loads the model at the requested layout (``loading.load_model``: standard, BigMac,
FarSkip, Sem-MoE placed and converted checkpoints alike), builds megatron-core's
``DynamicInferenceEngine`` (``megatron.inference.engine``) and runs the serving loop
(``megatron.inference.loop``). Attention is data-parallel over the ranks that do not share a
tensor-parallel group; experts are split over ``--expert-model-parallel-size`` ranks; requests go
to the data-parallel ranks in turn, or by a variant's request scheduler (``--semmoe-tables DIR``:
Sem-MoE's Algorithm 2). SIGTERM or SIGINT: stop accepting, finish in-flight requests
(``--shutdown-timeout``), exit 0.

One bad request fails alone (``frontend``, ``loop``). The engine itself failing (an exception in a
step or a collective, e.g. a peer rank died) fails every in-flight request with a 503 and exits 1;
a rank that stops making progress (stopped, hung, deadlocked: every peer then waits in a
collective) turns ``/health`` 503 after ``--stall-timeout`` and ends the server after
``--watchdog-timeout`` (in-flight requests get a 503, the process exits 3 with every thread's
stack on stderr; torchrun then stops the other ranks); a rank that has not entered the loop
``--startup-timeout`` after it started (stopped or hung while loading, or waiting for a rank that
is) exits 3 the same way. See docs/design/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import tempfile
import traceback

from megatron.common.cli import ArgumentParser, UserError
from megatron.common.process import EXIT_CRASH, EXIT_WATCHDOG, exit_now
from megatron.inference.options import (API_KEY_ENV, check_layout, checkpoint_chat, engine_config, frontend_config,
                                        http_url, served_name)

__all__ = ["build_parser", "main", "RANK_COMMAND"]

SERVE_EXTRA = ("hypercorn", "einops", "jinja2")
RANK_COMMAND = ("megatron.inference.serve",)  # what each torchrun rank of --nproc-per-node runs (python -m)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron.inference.serve", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, metavar="CKPT", help="checkpoint directory (newest checkpoint in it)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (see --ready-file)")
    p.add_argument("--variant", default=None, metavar="PRESET",
                   help="load the checkpoint with a registered variant preset applied (moe_variants.registry; "
                        "'+' combines): only presets that keep its parameters, e.g. a connectivity preset on a "
                        "standard checkpoint (the serving benchmark's --load runs); the checkpoint's architecture check "
                        "refuses the others")
    p.add_argument("--expert-comm", choices=("alltoall", "allreduce"), default="alltoall",
                   help="how tokens reach the experts: alltoall (dispatch and combine among the expert-parallel "
                        "ranks) or allreduce (vLLM's layout, TP = EP > 1: every rank holds every token, runs its "
                        "local experts, and one all-reduce sums them; a connectivity variant may overlap it)")
    p.add_argument("--served-model-name", default=None, help="the 'model' clients name (default: the --load directory's name)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step (prefills are chunked to fit)")
    p.add_argument("--max-requests", type=int, default=16, help="requests decoding at once per data-parallel rank")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="paged KV-cache buffer per rank")
    p.add_argument("--block-size-tokens", type=int, default=None, help="KV-cache block size (default 256 with flash-attn, else 32)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="prompt + output tokens (default: the checkpoint's seq_length)")
    p.add_argument("--paged-attention", choices=("batched", "loop"), default="batched",
                   help="plain-torch attention over the paged KV cache where flash-attn/FlashMLA are absent: all "
                        "requests of a step at once without host syncs (default), or loop, the per-request reference")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator of requests that give none "
                   "(mixed with the data-parallel rank)")
    p.add_argument("--ready-file", default=None, help="write {url, port, ...} as JSON here once serving")
    g = p.add_argument_group("processes")
    g.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run the HTTP front end in this process and N engine ranks under torchrun, started as its "
                        "child (one machine): the front end outlives the ranks, answers at once when rank 0 stops "
                        "or dies, and serves again when they restart (--max-restarts). Without it the front end "
                        "runs inside rank 0 (a world of one, or your own torchrun)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc-per-node: torchrun restarts the engine's ranks up to this many times after a "
                        "failure; the front end keeps its port, and the requests that have received nothing yet wait "
                        "for the restarted ranks")
    g.add_argument("--nnodes", type=int, default=1,
                   help="with --nproc-per-node: the engine's ranks span this many machines, N on each (torchrun's "
                        "c10d rendezvous at --rdzv-endpoint); run the same command on every machine with its "
                        "--node-rank: node 0 runs the front end, the others only ranks")
    g.add_argument("--node-rank", type=int, default=0, help="with --nnodes > 1: this machine's index (0: the front end)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: torchrun's rendezvous, on node 0 (its address as the others reach it)")
    g = p.add_argument_group("reliability")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (repeatable; or ${API_KEY_ENV}) on every path but "
                        "/health and /metrics")
    g.add_argument("--max-queued-requests", type=int, default=512,
                   help="requests waiting for their first token before new ones get 503 + Retry-After")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take before it is cancelled and answered 504 (0: no limit)")
    g.add_argument("--stall-timeout", type=float, default=30.0,
                   help="/health turns 503 when the engine loop made no progress for this long (grown to 5x the "
                        "slowest recent engine step, at most --max-stall-timeout)")
    g.add_argument("--max-stall-timeout", type=float, default=None, metavar="S",
                   help="the most --stall-timeout grows to with slow engine steps (default: 5x --stall-timeout)")
    g.add_argument("--watchdog-timeout", type=float, default=60.0,
                   help=f"a rank whose loop made no progress for this long (grown to 10x the slowest recent "
                        f"engine step, at most --max-watchdog-timeout) fails in-flight requests and exits "
                        f"{EXIT_WATCHDOG} (0: never)")
    g.add_argument("--max-watchdog-timeout", type=float, default=None, metavar="S",
                   help="the most --watchdog-timeout grows to with slow engine steps (default: 10x "
                        "--watchdog-timeout)")
    g.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help=f"a rank that has not entered the serving loop this many seconds after it started "
                        f"(loading the model, building the engine, waiting for a rank that is stopped or hung; "
                        f"after every restart too) exits {EXIT_WATCHDOG} (0: never)")
    g.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest request body (413 beyond)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (special tokens, chat template: lm-eval's remote tokenizer)")
    g = p.add_argument_group("statistics")
    g.add_argument("--routing-stats", action="store_true",
                   help="count local activations and expert load per device (Sem-MoE's LAR; attention-DP only): "
                        "the routers then read their top-k on the host in every MoE layer")
    g.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between the ranks' routing counts reaching /metrics")
    g.add_argument("--a2a-spans", metavar="DIR", default=None,
                   help="append each engine step's expert all-to-alls (name, launch, completion) to "
                        "DIR/a2a_spans_rank<R>.jsonl (bench_serve splits their time into transfer and rank-skew wait) "
                        "and each loop iteration's phases to DIR/loop_rank<R>.jsonl (tools.profile.replay_steps)")
    from moe_variants import registry

    registry.add_runtime_arguments(p)  # e.g. Sem-MoE's --semmoe-tables (request scheduling)
    return p


def _check_args(args) -> None:
    from megatron.inference.link import ENV_ADDRESS
    from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint

    try:
        if find_latest_checkpoint(args.load) is None:
            raise UserError(f"--load {args.load}: no complete checkpoint found")
    except CheckpointError as err:
        raise UserError(str(err)) from None
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    for flag in ("tensor_model_parallel_size", "expert_model_parallel_size", "max_queued_requests",
                 "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("request_timeout", "watchdog_timeout", "startup_timeout"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("stall_timeout", "metrics_interval"):
        if not getattr(args, flag) > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    for cap, flag in (("max_stall_timeout", "stall_timeout"), ("max_watchdog_timeout", "watchdog_timeout")):
        if getattr(args, cap) is not None and not getattr(args, cap) >= getattr(args, flag):
            raise UserError(f"--{cap.replace('_', '-')} must be >= --{flag.replace('_', '-')} "
                            f"{getattr(args, flag):g}, got {getattr(args, cap):g}")
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if "RANK" in os.environ and ENV_ADDRESS not in os.environ:
            raise UserError("--nproc-per-node starts torchrun itself: run python -m megatron.inference.serve "
                             "--nproc-per-node N without torchrun (or torchrun without --nproc-per-node)")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: need --nnodes >= 1 and "
                         f"0 <= --node-rank < --nnodes")
    if args.nnodes > 1:
        if args.nproc_per_node is None:
            raise UserError("--nnodes > 1 needs --nproc-per-node (under your own torchrun, give torchrun --nnodes)")
        host, _, port = (args.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (on node 0), "
                             f"got {args.rdzv_endpoint}")
    if args.max_restarts and args.nproc_per_node is None:
        raise UserError("--max-restarts needs --nproc-per-node (under your own torchrun, give torchrun "
                         "--max-restarts: the front end then restarts with rank 0)")
    if args.api_key is not None and not all(args.api_key):
        raise UserError("--api-key must not be empty")
    if args.ready_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.ready_file))):
        raise UserError(f"--ready-file {args.ready_file}: its directory does not exist")
    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"serving needs the 'serve' extra ({', '.join(missing)} missing): pip install -e '.[serve]'")
    # the process that serves HTTP, before any rank starts: rank 0 of node 0, or the front end of
    # --nproc-per-node (which holds the port across restarts: its ranks never bind it)
    if os.environ.get("RANK", "0") == "0" and args.node_rank == 0 and ENV_ADDRESS not in os.environ:
        from megatron.inference.frontend import check_address

        check_address(args.host, args.port)


def _init_distributed(stack) -> None:
    import torch.distributed as dist

    from megatron.components.parallel import init_from_env

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env(timeout_minutes=30)
    else:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="serve-"))
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    stack.callback(_teardown)


def _teardown() -> None:
    import torch.distributed as dist

    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine_failed(rank: int, frontend, err: BaseException, roster) -> None:
    """The loop raised: fail every in-flight request naming the rank that failed and why
    (``failures.describe``: a peer's death is named as such, not as this rank's collective
    error), log it (a traceback only for a failure of this rank's own), exit 1 at once (a teardown
    could wait on the peer that failed)."""
    from megatron.common.process import record_failure
    from megatron.inference.failures import describe
    from megatron.inference.loop import EngineDiverged

    report = describe(rank, err, roster)
    if frontend is not None:
        frontend.mark_dead(report.reason)
        frontend.wait_answered(2.0)
    if report.traceback and not isinstance(err, EngineDiverged):  # a divergence is said in full by its one line
        traceback.print_exc()
    record_failure(report.log[0])  # torchrun's closing summary names it
    print("\n".join(report.log[:-1] + [f"{report.log[-1]}; exiting with status {EXIT_CRASH}"]), file=sys.stderr,
          flush=True)
    exit_now(EXIT_CRASH)


def serve(args, argv=None, rank_command=RANK_COMMAND) -> int:
    """Serve: the front end of ``--nproc-per-node`` (``megatron.inference.launcher``), or a rank."""
    from megatron.inference.link import ENV_ADDRESS

    if args.nproc_per_node is not None and ENV_ADDRESS not in os.environ:
        from megatron.inference.launcher import run_frontend, run_node

        argv = list(sys.argv[1:] if argv is None else argv)
        if args.node_rank > 0:
            return run_node(args, argv, rank_command)
        return run_frontend(args, argv, rank_command)
    return serve_rank(args)


def serve_rank(args) -> int:
    """One rank of the engine; rank 0 also serves HTTP, or links to the front end process
    (``$MOE_SERVE_FRONTEND``)."""
    import torch.distributed as dist

    from megatron.inference.engine import RankEngine, build_engine
    from megatron.inference.failures import roster_for_job
    from megatron.inference.link import EngineLink, beat_interval, frontend_link
    from megatron.inference.loop import serve_loop
    from megatron.inference.observability import AllToAllCounters, LoopTrace, SpanRecorder
    from megatron.inference.protocol import Limits
    from megatron.common.process import fatal_exit
    from megatron.common.watchdog import Heartbeat
    from megatron.inference.watchdog import StallWatchdog
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants import registry

    cfg = engine_config(args)
    rank = int(os.environ.get("RANK", "0"))
    frontend = None
    heartbeat = Heartbeat()
    heartbeat.arm()  # from process start: loading, building and connecting have --startup-timeout

    def on_stall(age, why):
        if heartbeat.pulse().started:
            reason = f"the engine loop made no progress on rank {rank} for {age:.1f} s ({why}): a rank is " \
                     "stopped, hung or dead"
        else:
            reason = f"did not start serving within {age:.1f} s ({why}): this rank, or one it waits for, is " \
                     "stopped, hung or dead while starting"
        if frontend is not None:
            frontend.mark_dead(reason)
            frontend.wait_answered(2.0)
        fatal_exit(EXIT_WATCHDOG, f"rank {rank}: {reason}; exiting with status {EXIT_WATCHDOG}")

    watchdog = StallWatchdog(heartbeat, args.watchdog_timeout, on_stall, max_timeout_s=args.max_watchdog_timeout,
                             startup_timeout_s=args.startup_timeout).start()
    with contextlib.ExitStack() as stack:
        stack.callback(watchdog.stop)
        _init_distributed(stack)
        rank, world = dist.get_rank(), dist.get_world_size()
        roster = roster_for_job(rank, world)  # who failed, when a collective fails (failures.py)
        configs, manifest, ckpt, overrides, parallel = check_layout(args, world)
        scheduler = registry.request_scheduler(args, manifest, world)  # None: round-robin
        if args.tensor_model_parallel_size > 1 and scheduler is not None:
            raise UserError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: request scheduling "
                            f"({scheduler.name}) is for attention data-parallel layouts (TP = 1)")
        pgc = initialize_parallel(parallel, seed=args.seed)
        model, configs, tokenizer, manifest = load_model(args.load, parallel=parallel, overrides=overrides,
                                                         pg_collection=pgc)
        engine, controller, context = build_engine(model, configs, tokenizer, pgc, cfg)
        changed = registry.serving_model(args, manifest, model, pgc)  # e.g. Sem-MoE's Algorithm 3 (TP > 1)
        if args.expert_comm == "allreduce":
            if changed is not None:
                raise UserError("--expert-comm allreduce keeps every token on every rank; the variant's serving "
                                "change (e.g. Sem-MoE's Algorithm 3) re-batches them: use one or the other")
            from moe_variants.common.dispatcher import use_replicated_experts

            use_replicated_experts(model, pgc)
        tp1 = args.tensor_model_parallel_size == 1
        if not tp1 and args.routing_stats and changed is None:
            raise UserError("--routing-stats counts local activations of attention data-parallel layouts "
                            "(TP = 1) or of Sem-MoE's Algorithm 3: with plain TP > 1 every rank of a TP group "
                            "routes the same tokens")
        rank_engine = RankEngine(engine, controller, context, model,
                                 ep_rank=dist.get_rank(pgc.ep) if tp1 or changed is not None else None,
                                 ep_size=dist.get_world_size(pgc.ep), routing_stats=args.routing_stats,
                                 serving_model=changed)
        counters = AllToAllCounters(model)
        rank_engine.subscribe(counters)
        trace = None
        if args.a2a_spans:
            os.makedirs(args.a2a_spans, exist_ok=True)
            spans = stack.enter_context(open(os.path.join(args.a2a_spans, f"a2a_spans_rank{rank}.jsonl"), "a",
                                             buffering=1, encoding="utf-8"))
            recorder = SpanRecorder(counters, lambda record: spans.write(json.dumps(record) + "\n"),
                                    tp_group=None if tp1 else pgc.tp)
            stack.callback(recorder.close)
            rank_engine.subscribe(recorder)
            loop_file = stack.enter_context(open(os.path.join(args.a2a_spans, f"loop_rank{rank}.jsonl"), "a",
                                                 encoding="utf-8"))  # block-buffered: a line every iteration
            trace = LoopTrace(loop_file.write)

        stop = {"signal": None}

        def on_signal(signum, frame):
            stop["signal"] = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

        link = frontend_link()  # collective: rank 0 may be on another node than the front end
        if rank == 0:
            render, chat_kind = checkpoint_chat(manifest, ckpt)
            name = served_name(args)
            limits = Limits(context=context.max_sequence_length, vocab_size=tokenizer.vocab_size,
                            max_request_tokens=rank_engine.max_request_tokens)
            info = {"model": name, "world_size": world,
                    "tensor_model_parallel_size": args.tensor_model_parallel_size,
                    "expert_model_parallel_size": args.expert_model_parallel_size,
                    "data_parallel_size": dist.get_world_size(pgc.dp),
                    "context_length": context.max_sequence_length, "chat": chat_kind,
                    "kv_blocks_per_rank": rank_engine.stats()["kv_blocks_total"],
                    "max_request_tokens": rank_engine.max_request_tokens,
                    "routing_stats": rank_engine.activations is not None,
                    "request_scheduler": scheduler.name if scheduler is not None else "round-robin",
                    "token_scheduler": changed.name if changed is not None else None}
            layout = f"{world} ranks, EP {args.expert_model_parallel_size}, TP {args.tensor_model_parallel_size}"
            if link is not None:  # the front end runs in its own process (--nproc-per-node)
                address, authkey = link
                frontend = EngineLink.connect(address, bytes.fromhex(authkey), heartbeat,
                                              beat_interval(args.stall_timeout))
                frontend.hello(limits, info)
                print(f"engine serving {name} through the front end at {address} ({layout})", flush=True)
            else:
                from megatron.inference.frontend import Frontend

                frontend = Frontend(tokenizer=tokenizer, chat_render=render, heartbeat=heartbeat,
                                    config=frontend_config(args, limits))
                port = frontend.start()
                url = http_url(args.host, port)
                if args.ready_file:
                    from megatron.common.files import write_json

                    write_json(args.ready_file, {"url": url, "port": port, **info})
                print(f"serving {name} on {url} ({layout}; chat: {chat_kind})", flush=True)

        def on_iteration(busy):
            if rank == 0 and stop["signal"] is not None and not frontend.stop_requested.is_set():
                print(f"received signal {stop['signal']}: draining the requests in flight", flush=True)
                frontend.request_stop()

        try:
            serve_loop(rank_engine, pgc, frontend=frontend, on_iteration=on_iteration, heartbeat=heartbeat,
                       schedule=scheduler.online() if scheduler is not None else None,
                       stats_interval_s=args.metrics_interval, trace=trace)
        except Exception as err:
            _engine_failed(rank, frontend, err, roster)
        finally:
            watchdog.stop()
        if frontend is not None:
            frontend.join(timeout=args.shutdown_timeout + 10)
            if link is None:  # with a front end of its own, that process says it
                print("server stopped", flush=True)
    return 0


def main(argv=None, *, rank_command=RANK_COMMAND) -> int:
    """The command; with ``--nproc-per-node`` every torchrun rank runs ``python -m
    *rank_command`` with the same arguments (``tools.faults.rank`` wraps the ranks that way)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron import compat
    from megatron.inference.link import FrontendUnreachable
    from megatron.components.checkpointing import CheckpointError
    from megatron.common.cli import run_cli

    compat.quiet_warnings()

    def body():
        args = build_parser().parse_args(argv)
        _check_args(args)
        return serve(args, argv, rank_command)

    # a corrupt, unsafe or mismatched checkpoint (found while the model loads) is one line too, and so
    # is a $MOE_SERVE_FRONTEND that no front end answers on
    return run_cli("megatron.inference.serve", body,
                   user_errors=(UserError, CheckpointError, CheckpointException, FrontendUnreachable))


if __name__ == "__main__":
    sys.exit(main())
