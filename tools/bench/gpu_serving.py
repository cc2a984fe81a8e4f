"""Serving speed of the server's engine on one device, per paged-attention path, against its bound.

``run(preset)`` builds a model of the preset's shape with random weights (the GPU preset:
``examples/deepseek_v2_lite.yaml``'s model, MLA with a latent KV cache, 64 routed experts of FFN
1408 top-6 + 2 shared, vocabulary 102400, with as many of its 27 layers as fit in 60% of the device
memory; the cpu-smoke preset: a toy MLA model and a toy grouped-query one) and serves it with the
server's engine (``megatron.inference.engine``: ``build_engine`` and ``RankEngine``, one rank, the
plain-torch paged attention where flash-attn/FlashMLA are absent) once per attention path
(``loop``: per request; ``batched``: all requests of a step, no host sync; ``apply_inference``
switches them between measurements of the same engine). For each batch size B:

- prefill: B random prompts of ``prompt_tokens`` tokens, one output token each, stepped until all
  are done; tokens/s = B x prompt / the steps' wall time (``prefill_iters`` repetitions). Bound:
  the counted FLOPs at the device's dense bf16 peak (``megatron/training/flops.py``). FLOPs = 2 x
  the weights a token multiplies by (dense matrices, top-k routed experts, shared experts; the output layer once
  per prompt, as the engine computes only each request's last logits) + the attention, causal:
  2 x layers x heads x (d_qk + d_v) per (query, key seen) pair.
- decode: B requests with ``decode_context``-token prompts, prefilled, then ``iters`` single decode
  steps timed after ``warmup``; tokens/s = B / step time. Bound: the bytes a step must read at the
  device's HBM bandwidth (``megatron/training/flops.py`` ``HBM_TB_S``): the non-expert weights (the embedding table: the B rows
  looked up), the routed experts the step's real tokens were sent to (counted per layer in that
  step: every distinct expert once) and every request's KV cache (its context x the cache's bytes
  per token and layer). The host syncs of one decode step (``tools.bench.host_syncs``) are
  recorded per path.

Times are wall clock around whole engine steps (sampling included), CUDA-synchronised on a GPU:
medians with min, max and n. ``decode_ratio`` is the CPU comparison: decode steps at batch 32 of
the cpu-smoke models, loop and batched interleaved step by step (same engine and requests,
contexts one token apart), as the median of the per-pair ratios loop / batched; on a quiet machine:

    python -m tools.bench.gpu_serving --decode-ratio --out runs/serving_decode_ratio_cpu.json
    python -m tools.bench.gpu_serving --preset cpu-smoke --out runs/bench_gpu_serving_cpu-smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np

from megatron.common.cli import UserError, positive_int, run_cli, user_input

__all__ = ["PRESETS", "ServingPreset", "ServedModel", "run", "format_table", "decode_ratio",
           "decode_ratio_line", "main", "SCHEMA", "RATIO_SCHEMA"]

SCHEMA = "bench_gpu_serving/1"
RATIO_SCHEMA = "serving_decode_ratio/1"
PATHS = ("loop", "batched")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A model served with random weights: flat model flags (``configs_from_dict``) without
    ``num_layers`` and ``moe_layer_freq`` (``layers`` of them, the first dense), and the vocabulary."""

    name: str
    model: dict
    layers: int
    vocab_size: int
    fit_layers: bool = False  # fewer layers where the weights would exceed 60% of the device memory

    def flags(self, layers: int) -> dict:
        return {**self.model, "num_layers": layers, "moe_layer_freq": [0] + [1] * (layers - 1)}


@dataclasses.dataclass(frozen=True)
class ServingPreset:
    models: tuple
    batches: tuple
    prompt_tokens: int  # prefill: tokens per prompt
    decode_context: int  # decode: prompt tokens of each request before its timed steps
    warmup: int
    iters: int  # timed decode steps
    prefill_iters: int  # timed prefills of a whole batch
    max_batch_tokens: int  # the engine's step budget (prefill chunks)


_DSV2_LITE = dict(  # examples/deepseek_v2_lite.yaml's model
    hidden_size=2048, num_attention_heads=16, ffn_hidden_size=10944, seq_length=4096, max_position_embeddings=4096,
    multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=40, original_max_position_embeddings=4096,
    beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707, norm_epsilon=1e-6, num_experts=64, moe_router_topk=6,
    moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816, moe_router_pre_softmax=True, bf16=True,
    transformer_impl="local",
)
_TOY = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=256, num_experts=8,
            moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, bf16=False,
            transformer_impl="local")
_TOY_MLA = dict(_TOY, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=16)
_TOY_GQA = dict(_TOY, num_query_groups=2)

PRESETS = {
    "gpu": ServingPreset(models=(ServedModel("deepseek-v2-lite shape", _DSV2_LITE, 27, 102400, fit_layers=True),),
                         batches=(1, 16, 64, 256), prompt_tokens=512, decode_context=512, warmup=3, iters=10,
                         prefill_iters=3, max_batch_tokens=8192),
    "cpu-smoke": ServingPreset(models=(ServedModel("toy MLA", _TOY_MLA, 2, 512), ServedModel("toy GQA", _TOY_GQA, 2, 512)),
                               batches=(1, 4), prompt_tokens=16, decode_context=16, warmup=1, iters=2,
                               prefill_iters=2, max_batch_tokens=64),
}


def _log(message: str) -> None:
    print(f"bench_gpu_serving: {message}", file=sys.stderr, flush=True)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timing(times: list) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def _fit_layers(served: ServedModel, pgc) -> int:
    """``served.layers``, or fewer where the weights (counted on the meta device) would exceed 60%
    of the device memory (the rest: KV cache, activations)."""
    import torch

    from megatron.components.arguments import configs_from_dict
    from moe_variants.builder import build_model

    if not (served.fit_layers and torch.cuda.is_available()):
        return served.layers
    counts = []
    for layers in (2, 3):
        configs = configs_from_dict(served.flags(layers))
        with torch.device("meta"):
            model = build_model(configs.model, configs.parallel, vocab_size=served.vocab_size, pg_collection=pgc)
        counts.append(sum(p.numel() * p.element_size() for p in model.parameters()))
        del model
    per_layer, base = counts[1] - counts[0], 2 * counts[0] - counts[1]
    budget = 0.6 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return max(2, min(served.layers, int((budget - base) // per_layer)))


class _Served:
    """``served`` built with random weights and its engine (one rank), with what the bounds need:
    weight counts by kind and a per-step record of the routed experts."""

    def __init__(self, served: ServedModel, preset: ServingPreset, pgc, seed: int = 1234):
        import torch

        from megatron.compat.paged_attention import PagedAttention
        from megatron.inference.engine import EngineConfig, RankEngine, build_engine
        from megatron.components.arguments import configs_from_dict
        from megatron.components.tokenizer import build_tokenizer
        from moe_variants.builder import build_model
        from moe_variants.common.moe_layer import moe_layers

        self.layers = _fit_layers(served, pgc)
        configs = configs_from_dict(served.flags(self.layers))
        self.tokenizer = build_tokenizer("NullTokenizer", vocab_size=served.vocab_size - 1)
        self.model = build_model(configs.model, configs.parallel, vocab_size=served.vocab_size, pg_collection=pgc).eval()
        self.config = self.model.config
        self.batch_tokens = max(preset.max_batch_tokens, max(preset.batches))
        decode_tokens = self.decode_tokens(preset, preset.warmup + preset.iters + 1)
        longest = max(preset.prompt_tokens, preset.decode_context + decode_tokens)
        self.max_sequence_length = min(configs.model.seq_length, longest)
        self.kv_bytes_per_token = self._kv_bytes_per_token()  # all layers
        blocks = math.ceil(self.max_sequence_length / 64) + 1  # 64: the largest block size the engine picks here
        kv_gb = 1.5 * max(preset.batches) * blocks * 64 * self.kv_bytes_per_token / 2**30 + 0.01
        cfg = EngineConfig(max_batch_tokens=self.batch_tokens,
                           max_requests=max(preset.batches), kv_cache_gb=kv_gb,
                           max_sequence_length=self.max_sequence_length, seed=seed,
                           paged_attention=PagedAttention.BATCHED)
        self.engine = RankEngine(*build_engine(self.model, configs, self.tokenizer, pgc, cfg), self.model)
        self.rng = np.random.default_rng(seed)
        self.ids = iter(range(10**9))
        self._weights()
        self.routers = [layer.router for layer in moe_layers(self.model)]
        self.used: dict = {}  # layer number -> [E] bool: experts the step's real tokens were sent to
        self.real_tokens = 0
        self.device = next(self.model.parameters()).device
        torch.manual_seed(seed)

    def _kv_bytes_per_token(self) -> int:
        cfg, element = self.config, self.config.params_dtype.itemsize
        if getattr(cfg, "multi_latent_attention", False):
            return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * element  # the latent cache
        return cfg.num_layers * 2 * (cfg.num_query_groups or cfg.num_attention_heads) * cfg.kv_channels * element

    def _weights(self) -> None:
        """Matrix weights by kind: ``dense_per_token`` (what a token multiplies by outside the routed
        experts and the output layer), ``output``, ``embedding`` (one row per token read),
        ``expert`` (one routed expert's, by layer number), ``dense_bytes`` (every non-expert
        parameter but the embedding table)."""
        cfg = self.config
        self.expert = {}
        dense, output, embedding, dense_bytes = 0, 0, 0, 0
        for name, p in self.model.named_parameters():
            if ".experts." in name:
                layer = int(name.split("layers.")[1].split(".")[0]) + 1
                self.expert[layer] = self.expert.get(layer, 0) + p.numel() / cfg.num_moe_experts
                continue
            if "word_embeddings" in name:
                embedding = p.numel()
                continue
            dense_bytes += p.numel() * p.element_size()
            if "output_layer" in name:
                output = p.numel()
            elif p.dim() >= 2:
                dense += p.numel()
        self.dense_per_token, self.output, self.embedding_rows, self.dense_bytes = dense, output, embedding, dense_bytes
        self.element = cfg.params_dtype.itemsize

    # --- requests and steps -------------------------------------------------------------------
    def add(self, batch: int, length: int, max_tokens: int) -> None:
        from megatron.inference.sampling import RequestSampling

        eod = self.tokenizer.eod
        for _ in range(batch):
            prompt = [int(t) if t != eod else 0 for t in self.rng.integers(0, self.tokenizer.vocab_size, size=length)]
            self.engine.add(next(self.ids), prompt, max_tokens=max_tokens, sampling=RequestSampling(),
                            termination_id=-1)

    def decode_tokens(self, preset: ServingPreset, steps: int) -> int:
        """Output tokens a decode request asks for so that all of a batch still decode ``steps``
        steps after the last one's prefill: the first ones decode while the later ones prefill."""
        return math.ceil(max(preset.batches) * preset.decode_context / self.batch_tokens) + 2 + steps + 2

    def start_decoding(self, batch: int, preset: ServingPreset, steps: int) -> None:
        """``batch`` requests of ``decode_context`` prompt tokens, prefilled, with ``steps`` decode
        steps left to each (and a spare)."""
        self.add(batch, preset.decode_context, self.decode_tokens(preset, steps))
        while self.engine.engine.waiting_request_ids:  # their prefill (and first token)
            self.engine.step()
        if self.engine.context.get_active_request_count() != batch or not self.engine.context.is_decode_only():
            raise RuntimeError(f"decode at batch {batch}: the engine does not hold {batch} decoding requests")

    def kv_tokens(self) -> int:
        """Keys the next decode step attends over, summed over its requests."""
        return int(self.engine.context.get_active_sequence_lengths().sum())

    def timed_step(self) -> float:
        _sync()
        start = time.perf_counter()
        self.engine.step()
        _sync()
        return time.perf_counter() - start

    def drain(self) -> None:
        while self.engine.local_work():
            self.engine.step()

    def observe_routing(self, on: bool) -> None:
        def observer(layer_number, routing_map, probs):
            used = routing_map[:self.real_tokens].any(0)
            self.used[layer_number] = used if layer_number not in self.used else self.used[layer_number] | used

        for router in self.routers:
            router.routing_observer = observer if on else None

    # --- the measurements -------------------------------------------------------------------
    def prefill(self, batch: int, preset: ServingPreset) -> dict:
        times = []
        for _ in range(preset.prefill_iters):
            self.add(batch, preset.prompt_tokens, 1)
            total = 0.0
            while self.engine.local_work():
                total += self.timed_step()
            times.append(total)
        tokens = batch * preset.prompt_tokens
        timing = _timing(times)
        return {"batch": batch, "tokens": tokens, "time": timing, "tokens_per_s": tokens / timing["median_s"],
                "flops": self.prefill_flops(batch, preset.prompt_tokens)}

    def prefill_flops(self, batch: int, length: int) -> float:
        cfg = self.config
        per_token = 2.0 * (self.dense_per_token + cfg.moe_router_topk * sum(self.expert.values()))
        if getattr(cfg, "multi_latent_attention", False):
            d_qk, d_v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        else:
            d_qk = d_v = cfg.kv_channels
        pairs = length * (length + 1) / 2  # causal: query i sees i + 1 keys
        attention = 2.0 * cfg.num_layers * cfg.num_attention_heads * (d_qk + d_v) * pairs
        return batch * (length * per_token + attention + 2.0 * self.output)

    def decode(self, batch: int, preset: ServingPreset) -> dict:
        from tools.bench.host_syncs import HostSyncCounter

        self.start_decoding(batch, preset, preset.warmup + preset.iters + 1)
        for _ in range(preset.warmup):
            self.engine.step()
        times, moved, routed, contexts = [], [], [], []
        self.real_tokens = batch
        self.observe_routing(True)
        try:
            for _ in range(preset.iters):
                self.used = {}
                contexts.append(self.kv_tokens())
                times.append(self.timed_step())
                counts = {layer: int(self.used[layer].sum()) for layer in self.used}
                routed.append(sum(counts.values()))
                experts = sum(n * self.expert[layer] for layer, n in counts.items())
                kv = contexts[-1] * self.kv_bytes_per_token
                moved.append({"weights": self.dense_bytes + (batch * self.config.hidden_size + experts) * self.element,
                              "kv_cache": kv})
        finally:
            self.observe_routing(False)
        with HostSyncCounter() as syncs:
            self.engine.step()
        self.drain()
        timing = _timing(times)
        step_bytes = statistics.median(m["weights"] + m["kv_cache"] for m in moved)
        return {"batch": batch, "mean_context": statistics.median(contexts) / batch, "time": timing,
                "tokens_per_s": batch / timing["median_s"],
                "bytes_per_step": step_bytes, "kv_cache_bytes_per_step": statistics.median(m["kv_cache"] for m in moved),
                "routed_experts_per_step": statistics.median(routed), "host_syncs_per_step": syncs.count}


def _bounds(row: dict, kind: str, peak_tflops: Optional[float], bandwidth: Optional[float]) -> dict:
    """The row's bound (tokens/s at the FLOP or byte bound) and the fraction of it reached."""
    if kind == "prefill":
        seconds = row["flops"] / (peak_tflops * 1e12) if peak_tflops else None
        tokens = row["tokens"]
    else:
        seconds = row["bytes_per_step"] / (bandwidth * 1e12) if bandwidth else None
        tokens = row["batch"]
    if seconds is None:
        return {"bound_tokens_per_s": None, "fraction_of_bound": None}
    return {"bound_tokens_per_s": tokens / seconds, "fraction_of_bound": seconds / row["time"]["median_s"]}


def _environment(peak: Optional[float], bandwidth: Optional[float]) -> dict:
    import importlib.metadata
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "megatron_core": importlib.metadata.version("megatron-core"),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "peak_tflops": peak, "hbm_tb_s": bandwidth,
            "threads": torch.get_num_threads()}


def measure(preset_name: str, *, pg_collection=None, iters: Optional[int] = None, peak_tflops: Optional[float] = None,
            bandwidth_tb_s: Optional[float] = None, paths=PATHS, batches: Optional[tuple] = None) -> dict:
    """The serving measurements of ``preset_name`` in this process's world of one rank (the caller's:
    ``tools.bench.gpu``'s, or ``run``'s); a JSON-ready dict (module docstring). ``iters``: timed
    decode steps and prefills instead of the preset's; ``batches``: a subset of its batch sizes."""
    import torch

    from megatron.compat.inference import apply_inference
    from megatron.compat.paged_attention import PagedAttention
    from megatron.training.flops import hbm_bandwidth, peak_tflops as device_peak
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    preset = PRESETS[preset_name]
    if iters:
        preset = dataclasses.replace(preset, iters=iters, prefill_iters=iters)
    if batches:
        preset = dataclasses.replace(preset, batches=tuple(batches))
    peak = peak_tflops or device_peak(True)
    bandwidth = bandwidth_tb_s or hbm_bandwidth()
    began = time.monotonic()
    out = {"schema": SCHEMA, "preset": preset_name, "environment": _environment(peak, bandwidth),
           "settings": {k: v for k, v in dataclasses.asdict(preset).items() if k != "models"}, "models": [],
           "bounds": {"prefill": "counted FLOPs (module docstring) at the dense bf16 peak",
                      "decode": "non-expert weights + routed experts of the step + KV cache, read once at the "
                                "HBM bandwidth"}}
    pgc = pg_collection or initialize_parallel(ParallelConfig(), seed=1234)
    for served in preset.models:
        _log(f"building {served.name}")
        engine = _Served(served, preset, pgc)
        entry = {"name": served.name, "layers": engine.layers, "model": served.flags(engine.layers),
                 "vocab_size": served.vocab_size, "paths": {},
                 "weights": {"dense_bytes": engine.dense_bytes, "kv_cache_bytes_per_token": engine.kv_bytes_per_token,
                             "expert_bytes": {str(k): v * engine.element for k, v in engine.expert.items()}}}
        for path in paths:
            applied = apply_inference(PagedAttention(path))
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            rows = {"kernels": {k: applied[k] for k in ("attention_kernels", "mla_decode_kernel", "paged_attention")},
                    "prefill": [], "decode": []}
            for batch in preset.batches:
                _log(f"{served.name}: {path} prefill, batch {batch}")
                row = engine.prefill(batch, preset)
                rows["prefill"].append({**row, **_bounds(row, "prefill", peak, bandwidth)})
                _log(f"{served.name}: {path} decode, batch {batch}")
                row = engine.decode(batch, preset)
                rows["decode"].append({**row, **_bounds(row, "decode", peak, bandwidth)})
            rows["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            entry["paths"][path] = rows
        apply_inference(PagedAttention.BATCHED)
        out["models"].append(entry)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["elapsed_s"] = time.monotonic() - began
    return out


def run(preset_name: str, **kwargs) -> dict:
    """``measure`` in a world of one process of its own (or the caller's)."""
    from megatron.components.parallel import default_backend, single_process_group

    with single_process_group(only="python -m tools.bench.gpu_serving", backend=default_backend()):
        return measure(preset_name, **kwargs)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _span(timing: dict) -> str:
    return f"{1e3 * timing['median_s']:.1f} ({1e3 * timing['min_s']:.1f}-{1e3 * timing['max_s']:.1f}, n={timing['n']})"


def format_table(result: dict) -> str:
    """The human-readable summary of ``measure``'s result."""
    env = result["environment"]
    lines = [f"device {env['device']} (peak {_num(env['peak_tflops'], '.1f')} TFLOP/s bf16 dense, HBM "
             f"{_num(env['hbm_tb_s'], '.2f')} TB/s), torch {env['torch']}; times: median (min-max, n) ms"]
    for model in result["models"]:
        lines.append(f"{model['name']} ({model['layers']} layers)")
        lines.append(f"  {'path':<8} {'step':<8} {'batch':>5} {'time ms':<30} {'tokens/s':>11} {'bound':>11} "
                     f"{'%bound':>7} {'syncs':>5}")
        for path, rows in model["paths"].items():
            for kind in ("prefill", "decode"):
                for row in rows[kind]:
                    fraction = row["fraction_of_bound"]
                    lines.append(f"  {path:<8} {kind:<8} {row['batch']:>5} {_span(row['time']):<30} "
                                 f"{row['tokens_per_s']:>11.1f} {_num(row['bound_tokens_per_s'], '11.1f'):>11} "
                                 f"{_num(fraction and 100 * fraction, '.1f'):>7} "
                                 f"{row.get('host_syncs_per_step', ''):>5}")
    lines.append(f"total {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


# --- the CPU ratio -----------------------------------------------------------------------------


def decode_ratio(*, batch: int = 32, context: int = 128, repeats: int = 10, warmup: int = 2,
                 pg_collection=None) -> dict:
    """Decode steps at ``batch`` of each cpu-smoke model, the loop and the batched path alternating
    step by step (the first of each pair alternates too) on one engine: per path the step times,
    and the median of the per-pair ratios loop / batched with its min and max."""
    from megatron.compat.inference import apply_inference
    from megatron.compat.paged_attention import PagedAttention
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig
    from tools.bench.discipline import median_ci

    preset = dataclasses.replace(PRESETS["cpu-smoke"], batches=(batch,), decode_context=context, warmup=warmup,
                                 iters=2 * repeats, prompt_tokens=1, max_batch_tokens=512)
    pgc = pg_collection or initialize_parallel(ParallelConfig(), seed=1234)
    out = {"schema": RATIO_SCHEMA, "environment": _environment(None, None), "batch": batch, "context": context,
           "repeats": repeats, "warmup_steps": warmup, "models": []}
    for served in preset.models:
        engine = _Served(served, preset, pgc)
        engine.start_decoding(batch, preset, warmup + 2 * repeats)
        for _ in range(warmup):
            engine.engine.step()
        times = {path: [] for path in PATHS}
        for r in range(repeats):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                apply_inference(PagedAttention(path))
                times[path].append(engine.timed_step())
        apply_inference(PagedAttention.BATCHED)
        engine.drain()
        ratios = [slow / fast for slow, fast in zip(times["loop"], times["batched"])]
        out["models"].append({"name": served.name, "step_s": {path: _timing(t) for path, t in times.items()},
                              "ratio_loop_over_batched": median_ci(ratios)})
        del engine
        gc.collect()
    return out


def decode_ratio_line(batch: int, model: dict) -> str:
    """One model's ``decode_ratio`` result as a line: the ratio's median and its interval."""
    from tools.bench.discipline import interval_name

    ratio = model["ratio_loop_over_batched"]
    return (f"{model['name']}: decode step at batch {batch}, loop / batched {ratio['median']:.2f} "
            f"[{ratio['ci_low']:.2f}-{ratio['ci_high']:.2f}] ({interval_name(ratio['n'], unit='step pair')})")


# --- the command -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gpu_serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="gpu (the default on a GPU) or cpu-smoke (toy sizes, the default on a CPU)")
    parser.add_argument("--decode-ratio", action="store_true",
                        help="instead: the CPU ratio of decode steps, loop / batched, interleaved (cpu-smoke models)")
    parser.add_argument("--batch", type=positive_int, default=32, help="--decode-ratio: requests decoding (default 32)")
    parser.add_argument("--context", type=positive_int, default=128, help="--decode-ratio: prompt tokens (default 128)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="--decode-ratio: step pairs (default 10)")
    parser.add_argument("--iters", type=positive_int, default=None, help="timed repetitions (default: the preset's)")
    parser.add_argument("--out", default=None, help="JSON output (default runs/bench_gpu_serving_<preset>.json or "
                                                    "runs/serving_decode_ratio.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def main(argv=None) -> int:
    def body():
        import torch

        from megatron import compat
        from megatron.common.files import refuse_existing, write_json
        from megatron.components.parallel import single_process_group

        args = _parser().parse_args(argv)
        preset = args.preset or ("gpu" if torch.cuda.is_available() else "cpu-smoke")
        with user_input():
            if preset == "gpu" and not torch.cuda.is_available() and not args.decode_ratio:
                raise ValueError("--preset gpu needs a CUDA GPU; use --preset cpu-smoke on a CPU")
            default = "serving_decode_ratio.json" if args.decode_ratio else f"bench_gpu_serving_{preset}.json"
            out_path = args.out or os.path.join("runs", default)
            refuse_existing(out_path, "--out", args.overwrite)
        compat.quiet_warnings()
        if args.decode_ratio:
            with single_process_group(only="python -m tools.bench.gpu_serving"):
                result = decode_ratio(batch=args.batch, context=args.context, repeats=args.repeats)
            write_json(out_path, result)
            for model in result["models"]:
                print(decode_ratio_line(result["batch"], model), flush=True)
        else:
            result = run(preset, iters=args.iters)
            write_json(out_path, result)
            print(format_table(result), flush=True)
        print(f"wrote {out_path}", flush=True)

    return run_cli("python -m tools.bench.gpu_serving", body, user_errors=(UserError,))


if __name__ == "__main__":
    sys.exit(main())
