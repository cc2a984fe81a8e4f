"""The server's settings derived from its flags (``megatron.inference.serve``'s parser): the
engine's sizes, the checkpoint's configs at the requested layout, the front end's settings, the
chat template, the served name and the URL. Both processes of ``--nproc-per-node`` read them: the
ranks (``serve``) and the front end (``launcher``), which ``serve`` starts; so they live apart from
both."""

from __future__ import annotations

import os

from megatron.common.cli import UserError

__all__ = ["API_KEY_ENV", "variant_load_overrides", "chat_renderer", "api_keys", "engine_config", "check_layout",
           "served_name", "checkpoint_chat", "frontend_config", "http_url"]

API_KEY_ENV = "MOE_SERVE_API_KEY"


def variant_load_overrides(preset) -> dict:
    """Config overrides of ``--variant PRESET`` (the registry's benchmark presets), or {}."""
    if not preset:
        return {}
    from moe_variants import registry

    try:
        return registry.preset_overrides(preset)
    except UserError as err:
        raise UserError(str(err).replace("--variants:", "--variant:")) from None


def chat_renderer(tokenizer_dir: str | None):
    """The checkpoint tokenizer's chat template, else the simple documented one; and its name."""
    from megatron.inference.protocol import ChatTemplate, SIMPLE_CHAT_TEMPLATE, simple_chat_prompt

    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir) if tokenizer_dir else None
    if template is not None:
        return template, "tokenizer chat template"
    return simple_chat_prompt, f"simple template ({SIMPLE_CHAT_TEMPLATE})"


def api_keys(args) -> tuple:
    """``--api-key`` values, else ``$MOE_SERVE_API_KEY`` (comma-separated), else none."""
    if args.api_key:
        return tuple(args.api_key)
    env = os.environ.get(API_KEY_ENV, "")
    return tuple(k.strip() for k in env.split(",") if k.strip())


def engine_config(args):
    """The engine's sizes (``--max-batch-tokens`` ...), validated."""
    from megatron.compat.paged_attention import PagedAttention
    from megatron.inference.engine import EngineConfig

    cfg = EngineConfig(max_batch_tokens=args.max_batch_tokens, max_requests=args.max_requests,
                       kv_cache_gb=args.kv_cache_gb, block_size_tokens=args.block_size_tokens,
                       max_sequence_length=args.max_sequence_length, seed=args.seed,
                       paged_attention=PagedAttention(args.paged_attention))
    cfg.validate()
    return cfg


def check_layout(args, world: int):
    """The checkpoint's configs (with ``--variant``) at the requested layout over ``world`` ranks,
    refused in one line where they cannot be served; returns (configs, manifest, checkpoint dir,
    the ``--variant`` overrides, the ``ParallelConfig``)."""
    from megatron.components.loading import checkpoint_configs
    from moe_variants.config import ParallelConfig, validate

    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_comm == "allreduce" and not (tp > 1 and tp == ep):
        raise UserError(f"--expert-comm allreduce needs --tensor-model-parallel-size = --expert-model-parallel-size "
                         f"> 1 (every rank of the expert group holds the same tokens); got TP {tp}, EP {ep}")
    overrides = variant_load_overrides(args.variant)
    configs, manifest, ckpt = checkpoint_configs(args.load, overrides)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    validate(configs.model, parallel, world)
    if world % tp:
        raise UserError(f"--tensor-model-parallel-size {tp} does not divide the {world} ranks")
    return configs, manifest, ckpt, overrides, parallel


def served_name(args) -> str:
    return args.served_model_name or os.path.basename(os.path.abspath(args.load).rstrip("/"))


def checkpoint_chat(manifest: dict, ckpt: str):
    """The chat renderer of the checkpoint's tokenizer and its name (``chat_renderer``)."""
    tok_model = manifest.get("tokenizer_files", {}).get("tokenizer_model")
    return chat_renderer(os.path.dirname(os.path.join(ckpt, tok_model)) if tok_model else None)


def frontend_config(args, limits):
    """The HTTP front end's settings from the flags."""
    from megatron.inference.frontend import FrontendConfig

    return FrontendConfig(served_model=served_name(args), limits=limits, host=args.host, port=args.port,
                          shutdown_timeout=args.shutdown_timeout, api_keys=api_keys(args),
                          max_queued_requests=args.max_queued_requests, request_timeout=args.request_timeout,
                          stall_timeout=args.stall_timeout, max_stall_timeout=args.max_stall_timeout,
                          max_body_bytes=args.max_body_bytes,
                          enable_tokenizer_info=args.enable_tokenizer_info_endpoint)


def http_url(host: str, port: int) -> str:
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}"
