"""Serve a checkpoint of this project with an OpenAI-compatible HTTP API.

    torchrun --nproc_per_node=2 -m megatron.inference.serve --load CKPT --expert-model-parallel-size 2 \\
        [--tensor-model-parallel-size 1] [--host 127.0.0.1] [--port 8000] [--max-batch-tokens 512]

(``python -m megatron.inference.serve --load CKPT`` runs a world of one rank.) Every rank loads
the model at the requested layout (``loading.load_model``: standard, BigMac, FarSkip, Sem-MoE
placed and converted checkpoints alike), builds megatron-core's ``DynamicInferenceEngine``
(``megatron.inference.engine``) and runs the serving loop (``megatron.inference.loop``); rank 0
also serves HTTP (``megatron.inference.frontend``). Attention is data-parallel over the ranks
that do not share a tensor-parallel group; experts are split over ``--expert-model-parallel-size``
ranks; requests go to the data-parallel ranks in turn, or by a variant's request scheduler
(``--semmoe-tables DIR``: Sem-MoE's Algorithm 2). SIGTERM or SIGINT: stop accepting, finish in-flight requests (``--shutdown-timeout``),
exit 0. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.inference.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, metavar="CKPT", help="checkpoint directory (newest checkpoint in it)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (see --ready-file)")
    p.add_argument("--variant", default=None, metavar="PRESET",
                   help="load the checkpoint with a registered variant preset applied (moe_variants.registry; "
                        "'+' combines): only presets that keep its parameters, e.g. farskip on a standard "
                        "checkpoint (the serving benchmark's --load runs); the checkpoint's architecture check "
                        "refuses the others")
    p.add_argument("--served-model-name", default=None, help="the 'model' clients name (default: the --load directory's name)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step (prefills are chunked to fit)")
    p.add_argument("--max-requests", type=int, default=16, help="requests decoding at once per data-parallel rank")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="paged KV-cache buffer per rank")
    p.add_argument("--block-size-tokens", type=int, default=None, help="KV-cache block size (default 256 with flash-attn, else 32)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="prompt + output tokens (default: the checkpoint's seq_length)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed of requests that give none")
    p.add_argument("--ready-file", default=None, help="write {url, port, ...} as JSON here once serving")
    from moe_variants import registry

    registry.add_runtime_arguments(p)  # e.g. Sem-MoE's --semmoe-tables (request scheduling)
    return p


def _check_args(args) -> None:
    from megatron.training.checkpointing import CheckpointError, find_latest_checkpoint

    try:
        if find_latest_checkpoint(args.load) is None:
            raise ValueError(f"--load {args.load}: no complete checkpoint found")
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    for flag in ("tensor_model_parallel_size", "expert_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def _init_distributed(stack) -> None:
    import torch.distributed as dist

    from megatron.training.parallel import init_from_env

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


def variant_load_overrides(preset) -> dict:
    """Config overrides of ``--variant PRESET`` (the registry's benchmark presets), or {}."""
    if not preset:
        return {}
    from moe_variants import registry

    try:
        return registry.preset_overrides(preset)
    except ValueError as err:
        raise ValueError(str(err).replace("--variants:", "--variant:")) from None


def chat_renderer(tokenizer_dir: str | None):
    """The checkpoint tokenizer's chat template, else the simple documented one; and its name."""
    from megatron.inference.protocol import ChatTemplate, SIMPLE_CHAT_TEMPLATE, simple_chat_prompt

    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir) if tokenizer_dir else None
    if template is not None:
        return template, "tokenizer chat template"
    return simple_chat_prompt, f"simple template ({SIMPLE_CHAT_TEMPLATE})"


def serve(args) -> int:
    import torch.distributed as dist

    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.frontend import Frontend
    from megatron.inference.loop import serve_loop
    from megatron.training.loading import checkpoint_configs, load_model
    from megatron.training.parallel import initialize_parallel
    from moe_variants import registry
    from moe_variants.config import ParallelConfig, validate

    cfg = EngineConfig(max_batch_tokens=args.max_batch_tokens, max_requests=args.max_requests,
                       kv_cache_gb=args.kv_cache_gb, block_size_tokens=args.block_size_tokens,
                       max_sequence_length=args.max_sequence_length, seed=args.seed)
    cfg.validate()
    with contextlib.ExitStack() as stack:
        _init_distributed(stack)
        rank, world = dist.get_rank(), dist.get_world_size()
        overrides = variant_load_overrides(args.variant)
        configs, manifest, ckpt = checkpoint_configs(args.load, overrides)
        parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size)
        validate(configs.model, parallel, world)
        if world % args.tensor_model_parallel_size:
            raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide "
                             f"the {world} ranks")
        scheduler = registry.request_scheduler(args, manifest, world)  # None: round-robin
        pgc = initialize_parallel(parallel, seed=args.seed)
        model, configs, tokenizer, manifest = load_model(args.load, parallel=parallel, overrides=overrides,
                                                         pg_collection=pgc)
        engine, controller, context = build_engine(model, configs, tokenizer, pgc, cfg)
        tp1 = args.tensor_model_parallel_size == 1
        rank_engine = RankEngine(engine, controller, context, model, ep_rank=dist.get_rank(pgc.ep) if tp1 else None,
                                 ep_size=dist.get_world_size(pgc.ep))

        stop = {"signal": None}

        def on_signal(signum, frame):
            stop["signal"] = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

        frontend = None
        if rank == 0:
            tok_model = manifest.get("tokenizer_files", {}).get("tokenizer_model")
            render, chat_kind = chat_renderer(os.path.dirname(os.path.join(ckpt, tok_model)) if tok_model else None)
            name = args.served_model_name or os.path.basename(os.path.abspath(args.load).rstrip("/"))
            frontend = Frontend(tokenizer=tokenizer, served_model=name, context_length=context.max_sequence_length,
                                chat_render=render, host=args.host, port=args.port,
                                shutdown_timeout=args.shutdown_timeout)
            port = frontend.start()
            url = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{port}"
            info = {"url": url, "port": port, "model": name, "world_size": world,
                    "tensor_model_parallel_size": args.tensor_model_parallel_size,
                    "expert_model_parallel_size": args.expert_model_parallel_size,
                    "data_parallel_size": dist.get_world_size(pgc.dp),
                    "context_length": context.max_sequence_length, "chat": chat_kind,
                    "kv_blocks_per_rank": rank_engine.stats()["kv_blocks_total"],
                    "request_scheduler": scheduler.name if scheduler is not None else "round-robin"}
            if args.ready_file:
                from moe_variants.common.files import write_json

                write_json(args.ready_file, info)
            print(f"serving {name} on {url} ({world} ranks, EP {args.expert_model_parallel_size}, "
                  f"TP {args.tensor_model_parallel_size}; chat: {chat_kind})", flush=True)

        def on_iteration(busy):
            if rank == 0 and stop["signal"] is not None and not frontend.stop_requested.is_set():
                print(f"received signal {stop['signal']}: draining {frontend.in_flight} request(s)", flush=True)
                frontend.request_stop()

        serve_loop(rank_engine, pgc, frontend=frontend, on_iteration=on_iteration,
                   schedule=scheduler.online() if scheduler is not None else None)
        if frontend is not None:
            frontend.join(timeout=args.shutdown_timeout + 10)
            print("server stopped", flush=True)
    return 0


def main(argv=None) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron import compat
    from megatron.training.checkpointing import CheckpointError
    from moe_variants.common.cli import run_cli

    compat.quiet_warnings()

    def body():
        args = build_parser().parse_args(argv)
        _check_args(args)
        return serve(args)

    # a corrupt, unsafe or mismatched checkpoint (found while the model loads) is one line too
    return run_cli("megatron.inference.serve", body, user_errors=(ValueError, CheckpointError, CheckpointException))


if __name__ == "__main__":
    sys.exit(main())
