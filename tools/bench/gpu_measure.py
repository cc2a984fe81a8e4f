"""The measurements of ``python -m tools.bench.gpu``: one routed-expert layer, and training steps.

Both run in one process on this machine's device (the current GPU, else the CPU) in megatron-core
model-parallel groups of one rank, which the caller initialises (``tools/bench/gpu.py``). Times are
medians of ``iters`` timed repetitions after ``warmup`` untimed ones, with their min and max: CUDA
events on the compute stream around each repetition on a GPU (the stream is synchronised only
after the timed region), host clocks on the CPU.

FLOPs are counted, not measured. The expert layer: ``2 N (H glu F + F H)`` forward for ``N = T K``
routed copies (``glu`` = 2 for SwiGLU), three times that for forward and backward. Training: the
project's PaLM-style count (``megatron/training/flops.py``: ``6 x`` the active weights per token
plus attention), so MFU = achieved model FLOP/s / the device's dense bf16 peak.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import statistics
import time
from typing import Callable, Optional

import torch

__all__ = ["LayerShape", "TrainShape", "timed", "measure_layer", "measure_training", "train_in_child", "a2a_bytes_per_step"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One MoE layer's routed experts: ``tokens`` tokens routed top-``topk`` over ``num_experts``
    SwiGLU experts of width ``hidden`` -> ``ffn`` -> ``hidden``."""

    name: str
    hidden: int
    ffn: int
    num_experts: int
    topk: int
    tokens: int

    def flops_forward(self) -> float:
        return 2.0 * self.tokens * self.topk * (self.hidden * 2 * self.ffn + self.ffn * self.hidden)


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """A model trained end to end: flat model flags (``ModelConfig.from_flat``), the micro-batch and
    the vocabulary of the synthetic tokens."""

    name: str
    model: dict
    micro_batch_size: int
    vocab_size: int


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def timed(fn: Callable[[], object], *, warmup: int, iters: int) -> dict:
    """``{"median_s", "min_s", "max_s", "n"}`` of ``iters`` timed calls of ``fn`` after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": iters}


def _peak_memory_gb() -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _reset_peak_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _expert_modules(shape: LayerShape, bf16: bool, pg_collection):
    """The grouped module and the loop with the same weights (the loop loads the grouped state)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from moe_variants.builder import transformer_config
    from moe_variants.common.experts import GroupedExperts, RoutedExperts
    from moe_variants.config import ModelConfig, ParallelConfig

    model = ModelConfig(num_layers=1, hidden_size=shape.hidden, num_attention_heads=1, num_experts=shape.num_experts,
                        moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.ffn, bf16=bf16, transformer_impl="local")
    config = transformer_config(model, ParallelConfig())
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    grouped = RoutedExperts(shape.num_experts, config, sub, pg_collection, grouped=True)
    if not isinstance(grouped, GroupedExperts):
        raise ValueError(f"{shape.name}: the grouped kernel refuses this shape: {grouped.expert_path_reason}")
    loop = RoutedExperts(shape.num_experts, config, sub, pg_collection, grouped=False)
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


def _routed_inputs(shape: LayerShape, dtype, device, seed: int = 0):
    """Expert-sorted inputs of a uniform random top-k routing: x [N, H], tokens_per_expert [E] on
    the device (as the dispatcher hands them over at EP = 1), probs [N] fp32, dy [N, H]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(shape.tokens, shape.num_experts, generator=gen, device=device)
    experts = scores.topk(shape.topk, dim=1).indices
    counts = torch.bincount(experts.reshape(-1), minlength=shape.num_experts)
    n = shape.tokens * shape.topk
    x = torch.randn(n, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    probs = torch.rand(n, generator=gen, device=device).requires_grad_(True)
    dy = torch.randn(n, shape.hidden, generator=gen, device=device).to(dtype)
    return x, counts, probs, dy


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((got.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def _forward_backward(module, x, counts, probs, dy):
    for t in (x, probs, *module.parameters()):
        t.grad = None
    out, _ = module(x, counts, probs)
    out.backward(dy)
    return out


def _expert_grads(module) -> torch.Tensor:
    """[E, ...] weight gradients of either path, flattened per expert."""
    from moe_variants.common.experts import local_expert_weights

    return torch.stack([torch.cat([fc1.reshape(-1), fc2.reshape(-1)])
                        for fc1, fc2 in local_expert_weights(module, grad=True)])


def _check(grouped, loop, inputs, tolerance: float) -> dict:
    """Relative errors (norm of the difference over the loop's norm) of the output and of every
    gradient, grouped against the loop on the same weights and inputs."""
    x, counts, probs, dy = inputs
    results = {}
    for name, module in (("loop", loop), ("grouped", grouped)):
        out = _forward_backward(module, x, counts, probs, dy)
        results[name] = {"output": out.detach(), "input grad": x.grad.clone(), "probs grad": probs.grad.clone(),
                         "weight grads": _expert_grads(module)}
    errors = {k: _relative_error(results["grouped"][k], results["loop"][k]) for k in results["loop"]}
    worst = max(errors.values())
    return {"relative_errors": errors, "max_relative_error": worst, "tolerance": tolerance,
            "equal": worst <= tolerance}


def _count_syncs(fn) -> int:
    from tools.bench.host_syncs import HostSyncCounter, count_cuda_syncs

    if torch.cuda.is_available():
        return count_cuda_syncs(fn)[0]
    with HostSyncCounter() as syncs:
        fn()
    return syncs.count


def measure_layer(shape: LayerShape, *, bf16: bool, warmup: int, iters: int, pg_collection,
                  peak_tflops: Optional[float]) -> dict:
    """Forward and forward+backward of the grouped experts and the loop at ``shape``."""
    _reset_peak_memory()
    device = _device()
    grouped, loop = _expert_modules(shape, bf16, pg_collection)
    dtype = grouped.fc1_weight.dtype
    inputs = _routed_inputs(shape, dtype, device)
    x, counts, probs, dy = inputs
    # bf16 GEMMs accumulate in fp32 in a different order on each path: a few bf16 ulps
    check = _check(grouped, loop, inputs, tolerance=2e-2 if dtype == torch.bfloat16 else 1e-5)
    flops = shape.flops_forward()
    paths = {}
    for name, module in (("grouped", grouped), ("loop", loop)):
        _reset_peak_memory()

        def forward():
            module(x, counts, probs)

        def forward_backward():
            _forward_backward(module, x, counts, probs, dy)

        fwd = timed(forward, warmup=warmup, iters=iters)
        both = timed(forward_backward, warmup=warmup, iters=iters)
        result = {"forward": fwd, "forward_backward": both,
                  "tflops_forward": flops / fwd["median_s"] / 1e12,
                  "tflops_forward_backward": 3 * flops / both["median_s"] / 1e12,
                  "peak_memory_gb": _peak_memory_gb(),
                  "host_syncs_forward_backward": _count_syncs(forward_backward)}
        if peak_tflops:
            result["percent_of_peak_forward"] = 100 * result["tflops_forward"] / peak_tflops
            result["percent_of_peak_forward_backward"] = 100 * result["tflops_forward_backward"] / peak_tflops
        paths[name] = result
    return {"shape": dataclasses.asdict(shape), "dtype": str(dtype), "flops_forward": flops, "check": check,
            "paths": paths,
            "memory_note": "peak allocated while timing each path, both paths' weights resident"}


def _synthetic_batches(shape: TrainShape, seq_length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch_size, seq_length + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(shape.micro_batch_size, seq_length),
             "position_ids": torch.arange(seq_length)[None].expand(shape.micro_batch_size, -1).contiguous()}
    return itertools.repeat(batch)


def a2a_bytes_per_step(model, *, tokens: int, topk: int, ep: int, bytes_per_element: int) -> float:
    """Hidden-state bytes one step's all-to-alls would send from one rank at EP = ``ep`` under
    uniform routing (a routed copy stays local with probability 1/ep): dispatch and combine,
    forward and backward, over every MoE layer, in each layer's dispatched width (the experts'
    input width: the hidden size, or a variant's lower dimension)."""
    from moe_variants.common.moe_layer import moe_layers

    total = 0.0
    for layer in moe_layers(model):
        width = getattr(layer.experts, "input_size", None) or layer.config.moe_latent_size or layer.config.hidden_size
        total += 4 * tokens * topk * (ep - 1) / ep * width * bytes_per_element
    return total


def measure_training(shape: TrainShape, overrides: dict, *, warmup: int, iters: int,
                     peak_tflops: Optional[float], a2a_ep: int) -> dict:
    """Training steps of ``shape`` (with flat ``overrides``) through the project's
    ``setup_model_and_optimizer`` and ``train_step`` at EP = 1 on this one rank."""
    from megatron.core.utils import unwrap_model

    from megatron.training.config import TrainingConfig
    from megatron.training.flops import active_weights, flops_per_token
    from megatron.training.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer, train_step
    from moe_variants.common.experts import describe
    from moe_variants.config import ModelConfig, ParallelConfig

    _reset_peak_memory()
    model_cfg = ModelConfig.from_flat({**shape.model, **overrides})
    parallel = ParallelConfig()
    train_cfg = TrainingConfig(micro_batch_size=shape.micro_batch_size, global_batch_size=shape.micro_batch_size,
                               train_iters=warmup + iters + 1, lr=1e-4, lr_warmup_iters=0)
    pgc = initialize_parallel(parallel, seed=1234)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, parallel, train_cfg,
                                                             vocab_size=shape.vocab_size, pg_collection=pgc)
    model = unwrap_model(chunks[0])
    data = _synthetic_batches(shape, model_cfg.seq_length)
    losses = []

    def step():
        metrics = train_step(chunks, optimizer, scheduler, data, model_cfg=model_cfg, train_cfg=train_cfg,
                             num_microbatches=1, pg_collection=pgc)
        losses.append(metrics.lm_loss)
        return metrics

    first = step()
    timing = timed(step, warmup=max(warmup - 1, 0), iters=iters)
    tokens = shape.micro_batch_size * model_cfg.seq_length
    active = active_weights(model, num_experts=model_cfg.num_experts, topk=model_cfg.moe_router_topk,
                            num_local_experts=model_cfg.num_experts or 1)  # EP = 1: every expert is local
    per_token = flops_per_token(model.config, active, seq_length=model_cfg.seq_length)
    tflops = per_token * tokens / timing["median_s"] / 1e12
    out = {
        "experts": describe(model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "active_weights_per_token": active,
        "flops_per_token": per_token,
        "tokens_per_step": tokens,
        "step_time": timing,
        "tokens_per_s": tokens / timing["median_s"],
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "peak_memory_gb": _peak_memory_gb(),
        "first_loss": first.lm_loss,
        "last_loss": losses[-1],
        "a2a_bytes_per_step_measured": sum(first.comm[k] for k in ("bytes_dispatch", "bytes_combine", "bytes_backward")),
        f"a2a_bytes_per_step_ep{a2a_ep}_computed": a2a_bytes_per_step(
            model, tokens=tokens, topk=model_cfg.moe_router_topk, ep=a2a_ep,
            bytes_per_element=2 if model_cfg.bf16 else 4),
    }
    return out  # the model is freed with this frame; the next measurement collects it first


def train_in_child(rank: int, world: int, shape: TrainShape, overrides: dict, train_args: dict) -> dict:
    """``measure_training`` in a process of its own (``tools.spawn``'s one-rank world)."""
    return measure_training(shape, overrides, **train_args)
