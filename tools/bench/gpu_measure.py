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

__all__ = ["LayerShape", "TrainShape", "device", "peak_memory_gb", "reset_peak_memory", "timed", "measure_layer",
           "measure_training", "measure_training_interleaved", "train_in_child", "a2a_bytes_per_step"]


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
    the vocabulary of the synthetic tokens. ``fit_memory``: train as many of its layers as fit the
    GPU (``layers_that_fit``)."""

    name: str
    model: dict
    micro_batch_size: int
    vocab_size: int
    fit_memory: bool = False

    def with_layers(self, num_layers: int) -> "TrainShape":
        """The same model with its first ``num_layers`` layers (its MoE layer pattern cut to match)."""
        model = dict(self.model, num_layers=num_layers)
        if isinstance(model.get("moe_layer_freq"), list):
            model["moe_layer_freq"] = model["moe_layer_freq"][:num_layers]
        return dataclasses.replace(self, model=model)


# Bytes a trained parameter holds with megatron-core's bf16 optimizer (bf16 weight 2, fp32 gradient
# buffer 4, fp32 main weight 4, Adam's two fp32 moments 8), and the activations one layer of the
# fitted model keeps at sequence 4096, micro-batch 1 (its routed tokens' expert activations, MLA's
# projections, and the reference attention's score and probability matrices), with headroom
_BYTES_PER_PARAMETER = 18
_ACTIVATION_BYTES_PER_LAYER = 3 * 2**30
_USABLE_MEMORY = 0.85


def layers_that_fit(shape: TrainShape, memory_bytes: Optional[int] = None) -> int:
    """How many layers of ``shape`` fit one device with their optimizer state and activations:
    parameters counted on a two-layer copy built on the meta device (its first layer and a repeated
    one), at ``_BYTES_PER_PARAMETER`` plus ``_ACTIVATION_BYTES_PER_LAYER``, within ``_USABLE_MEMORY`` of
    ``memory_bytes`` (default: the current GPU's). Call ``initialize_parallel`` first."""
    from moe_variants.builder import build_model
    from moe_variants.config import ModelConfig, ParallelConfig

    if memory_bytes is None:
        memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    model_cfg = ModelConfig.from_flat(shape.with_layers(2).model)
    with torch.device("meta"):
        model = build_model(model_cfg, ParallelConfig(), vocab_size=shape.vocab_size)
    layers = model.decoder.layers
    fixed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in layers[1].parameters())
    per_layer = sum(p.numel() for p in layers[1].parameters())
    del model
    room = _USABLE_MEMORY * memory_bytes - _BYTES_PER_PARAMETER * fixed - _ACTIVATION_BYTES_PER_LAYER
    return max(1, min(shape.model["num_layers"],
                      1 + int(room // (_BYTES_PER_PARAMETER * per_layer + _ACTIVATION_BYTES_PER_LAYER))))


def device() -> torch.device:
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


def peak_memory_gb() -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reset_peak_memory() -> None:
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
    reset_peak_memory()
    dev = device()
    grouped, loop = _expert_modules(shape, bf16, pg_collection)
    dtype = grouped.fc1_weight.dtype
    inputs = _routed_inputs(shape, dtype, dev)
    x, counts, probs, dy = inputs
    # bf16 GEMMs accumulate in fp32 in a different order on each path: a few bf16 ulps
    check = _check(grouped, loop, inputs, tolerance=2e-2 if dtype == torch.bfloat16 else 1e-5)
    flops = shape.flops_forward()
    paths = {}
    for name, module in (("grouped", grouped), ("loop", loop)):
        reset_peak_memory()

        def forward():
            module(x, counts, probs)

        def forward_backward():
            _forward_backward(module, x, counts, probs, dy)

        fwd = timed(forward, warmup=warmup, iters=iters)
        both = timed(forward_backward, warmup=warmup, iters=iters)
        result = {"forward": fwd, "forward_backward": both,
                  "tflops_forward": flops / fwd["median_s"] / 1e12,
                  "tflops_forward_backward": 3 * flops / both["median_s"] / 1e12,
                  "peak_memory_gb": peak_memory_gb(),
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


class _TrainingRun:
    """One model of ``shape`` (with flat ``overrides``) set up for training through the project's
    ``setup_model_and_optimizer`` and ``train_step`` at EP = 1 on this one rank, on synthetic tokens.
    Call ``initialize_parallel`` first; the model is initialised from ``seed``."""

    def __init__(self, shape: TrainShape, overrides: dict, pg_collection, *, seed: int = 1234, train_iters: int = 1000):
        from megatron.core.utils import unwrap_model

        from megatron.components.config import TrainingConfig
        from megatron.components.parallel import set_seed
        from megatron.training.step import setup_model_and_optimizer
        from moe_variants.config import ModelConfig, ParallelConfig

        self.shape, self.pgc = shape, pg_collection
        self.model_cfg = ModelConfig.from_flat({**shape.model, **overrides})
        self.train_cfg = TrainingConfig(micro_batch_size=shape.micro_batch_size,
                                        global_batch_size=shape.micro_batch_size, train_iters=train_iters, lr=1e-4,
                                        lr_warmup_iters=0)
        set_seed(seed)
        self.chunks, self.optimizer, self.scheduler = setup_model_and_optimizer(
            self.model_cfg, ParallelConfig(), self.train_cfg, vocab_size=shape.vocab_size, pg_collection=pg_collection)
        self.model = unwrap_model(self.chunks[0])
        self.data = _synthetic_batches(shape, self.model_cfg.seq_length)
        self.losses = []
        self.first = None

    def step(self):
        from megatron.training.step import train_step

        metrics = train_step(self.chunks, self.optimizer, self.scheduler, self.data, model_cfg=self.model_cfg,
                             train_cfg=self.train_cfg, num_microbatches=1, pg_collection=self.pgc)
        self.losses.append(metrics.lm_loss)
        self.first = self.first or metrics
        return metrics

    def record(self, timing: dict, *, peak_tflops: Optional[float], a2a_ep: int) -> dict:
        """Throughput, FLOP rate and MFU of the median step in ``timing``, and what ran."""
        from megatron.training.flops import active_weights, flops_per_token
        from moe_variants import attention
        from moe_variants.common import experts

        cfg, model = self.model_cfg, self.model
        tokens = self.shape.micro_batch_size * cfg.seq_length
        active = active_weights(model, num_experts=cfg.num_experts, topk=cfg.moe_router_topk,
                                num_local_experts=cfg.num_experts or 1)  # EP = 1: every expert is local
        per_token = flops_per_token(model.config, active, seq_length=cfg.seq_length)
        tflops = per_token * tokens / timing["median_s"] / 1e12
        return {
            "num_layers": cfg.num_layers,
            "attention": attention.describe(model),
            "experts": experts.describe(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "active_weights_per_token": active,
            "flops_per_token": per_token,
            "tokens_per_step": tokens,
            "step_time": timing,
            "tokens_per_s": tokens / timing["median_s"],
            "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "peak_memory_gb": peak_memory_gb(),
            "first_loss": self.first.lm_loss,
            "last_loss": self.losses[-1],
            "a2a_bytes_per_step_measured": sum(self.first.comm[k] for k in ("bytes_dispatch", "bytes_combine",
                                                                            "bytes_backward")),
            f"a2a_bytes_per_step_ep{a2a_ep}_computed": a2a_bytes_per_step(
                model, tokens=tokens, topk=cfg.moe_router_topk, ep=a2a_ep, bytes_per_element=2 if cfg.bf16 else 4),
        }


def measure_training(shape: TrainShape, overrides: dict, *, warmup: int, iters: int,
                     peak_tflops: Optional[float], a2a_ep: int, breakdown_steps: int = 0) -> dict:
    """Training steps of one model (``_TrainingRun``): the first step, ``warmup`` more untimed,
    ``iters`` timed; with ``breakdown_steps``, that many more under the profiler
    (``tools/bench/breakdown.py``: where the step's time goes)."""
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig
    from tools.bench.breakdown import profile_steps

    reset_peak_memory()
    run = _TrainingRun(shape, overrides, initialize_parallel(ParallelConfig(), seed=1234))
    run.step()
    timing = timed(run.step, warmup=max(warmup - 1, 0), iters=iters)
    out = run.record(timing, peak_tflops=peak_tflops, a2a_ep=a2a_ep)
    if breakdown_steps:
        out["breakdown"] = profile_steps(run.step, run.model, run.optimizer, steps=breakdown_steps)
    return out  # the model is freed with this frame; the next measurement collects it first


def measure_training_interleaved(shape: TrainShape, variants: dict, *, warmup: int, iters: int, rounds: int,
                                 peak_tflops: Optional[float], a2a_ep: int, breakdown_arm: Optional[str] = None,
                                 breakdown_steps: int = 0) -> dict:
    """Several models of ``shape`` (``{name: overrides}``) timed in turns in this one process: each
    round times ``iters`` steps of every model, the order reversed every other round, so that a
    machine's drift falls on all of them alike (how a same-run ratio is taken on a shared CPU).
    Per model: its record over all rounds' steps; per pair against the first model: the ratio of
    their per-round median step times, as a median with its interval over the rounds. With
    ``breakdown_arm``, that model then runs ``breakdown_steps`` more under the profiler."""
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig
    from tools.bench.discipline import median_ci

    pgc = initialize_parallel(ParallelConfig(), seed=1234)
    runs = {name: _TrainingRun(shape, overrides, pgc) for name, overrides in variants.items()}
    for run in runs.values():
        for _ in range(max(warmup, 1)):
            run.step()
    per_round = {name: [] for name in runs}
    order = list(runs)
    for index in range(rounds):
        for name in (order if index % 2 == 0 else order[::-1]):
            per_round[name].append(timed(runs[name].step, warmup=0, iters=iters)["median_s"])
    records = {}
    for name, run in runs.items():
        times = per_round[name]
        timing = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": rounds,
                  "unit": f"median of {iters} steps per round"}
        records[name] = run.record(timing, peak_tflops=peak_tflops, a2a_ep=a2a_ep)
    if breakdown_arm and breakdown_steps:
        from tools.bench.breakdown import profile_steps

        run = runs[breakdown_arm]
        records[breakdown_arm]["breakdown"] = profile_steps(run.step, run.model, run.optimizer, steps=breakdown_steps)
    first = order[0]
    ratios = {f"{first}/{name}": median_ci([a / b for a, b in zip(per_round[first], per_round[name])])
              for name in order[1:]}
    return {"variants": records, "step_time_ratios": ratios, "rounds": rounds, "iters_per_round": iters}


def train_in_child(rank: int, world: int, shape: TrainShape, overrides: dict, train_args: dict) -> dict:
    """``measure_training`` in a process of its own (``tools.spawn``'s one-rank world); a model
    that does not fit the device comes back as ``{"out_of_memory": message}``."""
    try:
        return measure_training(shape, overrides, **train_args)
    except torch.OutOfMemoryError as exc:
        return {"out_of_memory": str(exc).splitlines()[0]}
