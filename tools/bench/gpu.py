"""``python -m tools.bench.gpu``: how fast the model and its parts run on one GPU, against their bounds.

Sections, each run in one process on the current GPU (NCCL world of one rank) or, for CI, on the
CPU at toy sizes (``--preset cpu-smoke``, gloo):

- ``layer``: one MoE layer's routed experts, forward and forward+backward, grouped GEMMs against
  megatron-core's ``SequentialMLP`` loop, at Qwen3-30B-A3B's layer (hidden 2048, expert FFN 768,
  128 experts, top-8, 32k tokens) and at DeepSeek-V2-Lite's routed experts (2048, 1408, 64, top-6):
  TFLOP/s, percent of the dense bf16 peak, host syncs, grouped checked against the loop;
- ``attention``: one core attention at sequence 4096, forward and forward+backward TFLOP/s, per
  ``--attention-backend`` (``local``: megatron-core's ``DotProductAttention``; the rest: torch's
  scaled_dot_product_attention), at Qwen3-30B-A3B's GQA shape and DeepSeek-V2-Lite's MLA shape
  (``tools/bench/gpu_attention.py``);
- ``train``: end-to-end training steps through the project's ``setup_model_and_optimizer`` and
  ``train_step`` at sequence 4096, EP = 1, bf16, for a DeepSeek-V2-Lite-shaped model (its layers,
  MLA, 64 routed experts of FFN 1408 + 2 shared, top-6; as many layers as fit the GPU with the
  optimizer) and a 1.3B fine-grained MoE (12 layers, hidden 1024, 64 experts of 512, top-8), each
  with the reference attention (``local``) and the fast one (``auto``): tokens/s, TFLOP/s, MFU, peak
  memory;
- ``breakdown``: where the fast arm's step time goes, per category (attention, expert GEMMs,
  permutation/dispatch, router, dense GEMMs, norms and elementwise, loss and embedding, optimizer,
  other, idle) from ``torch.profiler`` (``tools/bench/breakdown.py``); it runs inside that arm's
  training process;
- ``serving``: the DeepSeek-V2-Lite shape (random weights) in the server's engine, prefill and
  decode tokens/s at several batch sizes against their FLOP and byte bounds, per paged-attention
  path (``tools/bench/gpu_serving.py``);
- ``variants`` (not in the default run): every registered variant that replaces the MoE layer,
  trained like ``train`` with the fast attention, against the standard layer; the all-to-all bytes
  per step computed for EP = 8.

GPU training runs each happen in a process of their own (a model's memory is only returned when its
process exits). On the CPU (``--preset cpu``: a training step at sequence 1024, the attention and a
decode step at batch 32) the arms are timed in turns in one process, the order reversed every other
round, and the JSON gives each ratio's median over the rounds with its interval: the same-run
ratio the attention change buys on a CPU.

Times are medians of repeated runs after a warm-up, with min and max (``gpu_measure.timed``).
``--time-budget-s`` (default 570 s from the start) skips the items that would not fit, says which,
and the JSON records them under ``skipped``. The JSON is written atomically to ``--out`` and a table
is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import sys
import time
from typing import Optional

from megatron.common.cli import UserError, positive_float, positive_int, run_cli, user_input
from tools.bench.gpu_attention import AttentionShape
from tools.bench.gpu_measure import LayerShape, TrainShape

__all__ = ["PRESETS", "Preset", "run", "format_table", "main", "SCHEMA", "SECTIONS", "DEFAULT_SECTIONS"]

SCHEMA = "bench_gpu/2"
SECTIONS = ("layer", "attention", "train", "breakdown", "serving", "variants")
DEFAULT_SECTIONS = ("layer", "attention", "train", "breakdown", "serving")
A2A_EP = 8  # the expert-parallel size the computed all-to-all bytes are for
REFERENCE_ARM = "local"  # the arm every other training arm is compared with


@dataclasses.dataclass(frozen=True)
class Preset:
    """What one run measures and how often. ``arms`` are the training configurations compared
    (name -> flat overrides); ``rounds`` > 0 times them in turns in one process (the CPU ratio),
    else each in a process of its own after the other; ``serving`` names a ``gpu_serving`` preset,
    or ``decode-ratio`` for its same-run CPU ratio at batch 32; the ``*_estimate_s`` are the
    seconds each item is expected to take (for ``--time-budget-s``)."""

    layers: tuple
    attention: tuple
    attention_backends: tuple
    train: tuple
    arms: tuple
    serving: Optional[str]
    bf16: bool
    warmup: int
    iters: int
    train_warmup: int
    train_iters: int
    breakdown_steps: int
    rounds: int
    layer_estimate_s: float
    attention_estimate_s: float
    train_estimate_s: float
    serving_estimate_s: float


_ARMS = (("local", {"attention_backend": "local"}), ("auto", {"attention_backend": "auto"}))

# DeepSeek-V2-Lite (examples/deepseek_v2_lite.yaml) without its parallel and training settings; the
# number of layers is set to what fits the device (fit_memory)
_DSV2_LITE = dict(
    num_layers=27, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=10944, seq_length=4096,
    max_position_embeddings=4096, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=40,
    original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707, norm_epsilon=1e-6, num_experts=64,
    moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816, moe_layer_freq=[0] + [1] * 26,
    moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-3, bf16=True, transformer_impl="local",
)
_FINE_GRAINED_1B = dict(
    num_layers=12, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, seq_length=4096,
    max_position_embeddings=4096, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512, moe_layer_freq=1,
    moe_aux_loss_coeff=1e-3, bf16=True, transformer_impl="local",
)


def _tiny(seq: int, **extra) -> dict:
    return dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=seq,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=1, moe_aux_loss_coeff=1e-3,
                bf16=False, transformer_impl="local", **extra)


_TINY_MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                 moe_shared_expert_intermediate_size=32)

PRESETS = {
    "gpu": Preset(
        layers=(LayerShape("qwen3-30b-a3b", 2048, 768, 128, 8, 32768),
                LayerShape("deepseek-v2-lite routed", 2048, 1408, 64, 6, 32768)),
        attention=(AttentionShape("qwen3-30b-a3b gqa", 2, 4096, 32, 4, 128, 128),
                   AttentionShape("deepseek-v2-lite mla", 4, 4096, 16, 16, 192, 128)),
        attention_backends=("local", "auto", "flash", "fused"),
        train=(TrainShape("deepseek-v2-lite shape, seq 4096", _DSV2_LITE, micro_batch_size=1, vocab_size=102400,
                          fit_memory=True),
               TrainShape("fine-grained MoE 1.3B, seq 4096", _FINE_GRAINED_1B, micro_batch_size=2, vocab_size=32768)),
        arms=_ARMS, serving="gpu", bf16=True, warmup=3, iters=10, train_warmup=3, train_iters=8, breakdown_steps=3,
        rounds=0, layer_estimate_s=30, attention_estimate_s=15, train_estimate_s=75, serving_estimate_s=150,
    ),
    "cpu": Preset(
        layers=(),
        attention=(AttentionShape("gqa, seq 1024", 1, 1024, 8, 2, 64, 64),
                   AttentionShape("mla, seq 1024", 1, 1024, 8, 8, 96, 64)),
        attention_backends=("local", "auto"),
        train=(TrainShape("small MoE, seq 1024", dict(_tiny(1024), hidden_size=256, num_attention_heads=4,
                                                      ffn_hidden_size=512, moe_ffn_hidden_size=256),
                          micro_batch_size=2, vocab_size=1024),),
        arms=_ARMS, serving="decode-ratio", bf16=False, warmup=1, iters=3, train_warmup=1, train_iters=3, breakdown_steps=2,
        rounds=5, layer_estimate_s=5, attention_estimate_s=20, train_estimate_s=240, serving_estimate_s=240,
    ),
    "cpu-smoke": Preset(
        layers=(LayerShape("tiny 8x32", 64, 32, 8, 2, 128),),
        attention=(AttentionShape("tiny gqa", 1, 64, 4, 2, 16, 16), AttentionShape("tiny mla", 1, 64, 4, 4, 24, 16)),
        attention_backends=("local", "auto", "unfused"),
        train=(TrainShape("tiny MoE, seq 64", _tiny(64), micro_batch_size=2, vocab_size=256),
               TrainShape("tiny MLA MoE, seq 64", _tiny(64, **_TINY_MLA), micro_batch_size=2, vocab_size=256)),
        arms=_ARMS, serving="cpu-smoke", bf16=False, warmup=1, iters=2, train_warmup=1, train_iters=2,
        breakdown_steps=1, rounds=0, layer_estimate_s=2, attention_estimate_s=2, train_estimate_s=5,
        serving_estimate_s=20,
    ),
}


class Budget:
    """Seconds left of ``--time-budget-s`` since ``start``; ``allows(estimate)`` is whether an item
    of that expected length still fits."""

    def __init__(self, total_s: float, start: float):
        self.total_s, self.start = total_s, start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, estimate_s: float) -> bool:
        return self.elapsed() + estimate_s <= self.total_s


def _environment(peak: Optional[float]) -> dict:
    import torch

    from megatron.training.flops import hbm_bandwidth

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "peak_tflops": peak,
        "peak_note": ("dense bf16 peak of this device (megatron/training/flops.py PEAK_BF16_TFLOPS: H100 and H200 "
                      "SXM 989.4) or --peak-tflops" if peak else "no peak known: percentages and MFU omitted"),
        "hbm_bandwidth_tb_s": hbm_bandwidth(),
        "load_average_at_start": os.getloadavg()[0],  # other work on the machine skews CPU timings
        "cpu_threads": torch.get_num_threads(),
    }


def _log(message: str) -> None:
    print(f"bench_gpu: {message}", file=sys.stderr, flush=True)


def _train_isolated(shape, overrides: dict, train_args: dict) -> dict:
    """One training arm in a process of its own on a GPU: megatron-core's DDP keeps a model alive
    through the autograd hooks it puts on the parameters (a cycle through C++ that Python's
    collector cannot free), so models trained one after another in one process add up; the process's
    exit returns the memory. On the CPU (toy models) it runs in this process."""
    import torch

    from megatron.components.parallel import default_backend
    from tools.bench.gpu_measure import measure_training, train_in_child
    from tools.spawn import run_distributed

    if not torch.cuda.is_available():
        return measure_training(shape, overrides, **train_args)
    return run_distributed(train_in_child, 1, shape, overrides, train_args, backend=default_backend(),
                           timeout_s=900, num_threads=4)[0]


def _train_shape(shape: TrainShape, preset: Preset, arms: tuple, train_args: dict, breakdown: bool) -> dict:
    """Every arm of one model: ``{"arms": {name: record}, "check": ..., ["ratios"], ["layers_note"]}``.
    A model that must fit the GPU (``fit_memory``) starts at ``gpu_measure.layers_that_fit`` and loses
    a layer whenever an arm runs out of memory (every arm at the same depth)."""
    from tools.bench.gpu_measure import layers_that_fit, measure_training_interleaved

    if preset.rounds:
        result = measure_training_interleaved(shape, dict(arms), rounds=preset.rounds,
                                              breakdown_arm=None if not breakdown else arms[-1][0],
                                              breakdown_steps=preset.breakdown_steps, **train_args)
        out = {"arms": result["variants"], "ratios": result["step_time_ratios"], "rounds": result["rounds"],
               "iters_per_round": result["iters_per_round"]}
    else:
        fitted = layers_that_fit(shape) if shape.fit_memory else None
        while True:
            sized = shape if fitted is None else shape.with_layers(fitted)
            out = {"arms": {}}
            for name, overrides in arms:
                args = dict(train_args, breakdown_steps=preset.breakdown_steps if breakdown and name != REFERENCE_ARM else 0)
                out["arms"][name] = _train_isolated(sized, overrides, args)
            short = [name for name, r in out["arms"].items() if "out_of_memory" in r]
            if not short or fitted is None or fitted <= 2:
                break
            _log(f"{shape.name}: out of memory at {fitted} layers ({', '.join(short)}); trying {fitted - 1}")
            fitted -= 1
        if fitted is not None:
            out["layers_note"] = (f"{fitted} layers: as many as fit the GPU with the optimizer "
                                  "(gpu_measure.layers_that_fit, one fewer per out-of-memory arm)")
    ran = {name: r for name, r in out["arms"].items() if "out_of_memory" not in r}
    if REFERENCE_ARM in ran and len(ran) > 1:
        out["check"] = {name: _loss_check(r, ran[REFERENCE_ARM], preset.bf16)
                        for name, r in ran.items() if name != REFERENCE_ARM}
    return out


def run(preset_name: str, *, sections=DEFAULT_SECTIONS, time_budget_s: float = 570.0,
        peak_tflops: Optional[float] = None, iters: Optional[int] = None, start: Optional[float] = None) -> dict:
    """Measure ``sections`` of preset ``preset_name`` (``iters`` timed repetitions instead of the
    preset's); the result as a JSON-ready dict."""
    from megatron.training.flops import peak_tflops as device_peak
    from megatron.components.parallel import default_backend, initialize_parallel, single_process_group
    from moe_variants import registry
    from moe_variants.config import ParallelConfig
    from tools.bench.gpu_attention import measure_attention
    from tools.bench.gpu_measure import measure_layer

    preset = PRESETS[preset_name]
    if iters:
        preset = dataclasses.replace(preset, iters=iters, train_iters=iters)
    budget = Budget(time_budget_s, time.monotonic() if start is None else start)
    peak = peak_tflops or device_peak(preset.bf16)
    out = {"schema": SCHEMA, "preset": preset_name, "sections": list(sections), "environment": _environment(peak),
           "time_budget_s": time_budget_s, "layer": [], "attention": [], "train": {}, "serving": None,
           "variants": [], "skipped": [],
           "flops": {"layer_forward": "2 x tokens x top-k x (hidden x 2 ffn + ffn x hidden) (SwiGLU); "
                                      "forward+backward: 3x",
                     "attention": "causal: 2 b h s^2 (d_qk + d_v) / 2 forward; forward+backward: 3.5x",
                     "train": "megatron/training/flops.py: 6 x active weights per token + attention (PaLM)"}}

    def fits(item: str, estimate_s: float) -> bool:
        if budget.allows(estimate_s):
            _log(f"{item} ({budget.elapsed():.0f} s elapsed)")
            return True
        reason = (f"time budget: {budget.elapsed():.0f} s of {time_budget_s:.0f} s used, the item takes about "
                  f"{estimate_s:.0f} s")
        out["skipped"].append({"item": item, "reason": reason})
        _log(f"skipped {item}: {reason}")
        return False

    with single_process_group(only="python -m tools.bench.gpu", backend=default_backend()):
        pgc = None
        if "layer" in sections:
            for shape in preset.layers:
                if fits(f"layer {shape.name}", preset.layer_estimate_s):
                    began = budget.elapsed()
                    pgc = pgc or initialize_parallel(ParallelConfig(), seed=1234)
                    result = measure_layer(shape, bf16=preset.bf16, warmup=preset.warmup, iters=preset.iters,
                                           pg_collection=pgc, peak_tflops=peak)
                    out["layer"].append({**result, "wall_s": budget.elapsed() - began})
        if "attention" in sections:
            for shape in preset.attention:
                if fits(f"attention {shape.name}", preset.attention_estimate_s):
                    began = budget.elapsed()
                    pgc = pgc or initialize_parallel(ParallelConfig(), seed=1234)
                    result = measure_attention(shape, preset.attention_backends, bf16=preset.bf16,
                                               warmup=preset.warmup, iters=preset.iters, pg_collection=pgc,
                                               peak_tflops=peak)
                    out["attention"].append({**result, "wall_s": budget.elapsed() - began})
        train_args = dict(warmup=preset.train_warmup, iters=preset.train_iters, peak_tflops=peak, a2a_ep=A2A_EP)
        if "train" in sections or "breakdown" in sections:
            arms = preset.arms if "train" in sections else tuple(a for a in preset.arms if a[0] != REFERENCE_ARM)
            for shape in preset.train:
                estimate = preset.train_estimate_s * (len(arms) if not preset.rounds else 1)
                if fits(f"train {shape.name}", estimate):
                    began = budget.elapsed()
                    result = _train_shape(shape, preset, arms, train_args, breakdown="breakdown" in sections)
                    out["train"][shape.name] = {**result, "wall_s": budget.elapsed() - began}
        if "serving" in sections and preset.serving:
            if fits("serving", preset.serving_estimate_s):
                from tools.bench import gpu_serving

                began = budget.elapsed()
                pgc = pgc or initialize_parallel(ParallelConfig(), seed=1234)
                if preset.serving == "decode-ratio":  # the same-run CPU ratio of the two attention paths
                    result = gpu_serving.decode_ratio(batch=32, pg_collection=pgc)
                else:
                    result = gpu_serving.measure(preset.serving, pg_collection=pgc, peak_tflops=peak)
                out["serving"] = {**result, "wall_s": budget.elapsed() - began}
        if "variants" in sections:
            shape = preset.train[-1]
            for variant in registry.variants():
                if variant.moe_layer is None:
                    continue
                if fits(f"variant {variant.name}", preset.train_estimate_s):
                    began = budget.elapsed()
                    result = _train_isolated(shape, {"moe_variant": variant.moe_layer}, train_args)
                    out["variants"].append({"variant": variant.name, "model": shape.name, **result,
                                            "wall_s": budget.elapsed() - began})
    out["elapsed_s"] = budget.elapsed()
    return out


def _loss_check(arm: dict, reference: dict, bf16: bool) -> dict:
    """The first step's loss of two arms (same seed, same data: the same model)."""
    tolerance = 2e-2 if bf16 else 1e-5  # relative; bf16 kernels accumulate in different orders
    error = abs(arm["first_loss"] - reference["first_loss"]) / abs(reference["first_loss"])
    return {"first_loss_relative_error": error, "tolerance": tolerance, "equal": error <= tolerance}


def _ms(timing: dict) -> str:
    return f"{1e3 * timing['median_s']:.2f} ({1e3 * timing['min_s']:.2f}-{1e3 * timing['max_s']:.2f}, n={timing['n']})"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _layer_lines(result: dict) -> list:
    lines = [f"{'expert layer':<26} {'path':<8} {'forward ms':<26} {'TF/s':>7} {'%peak':>6}  "
             f"{'fwd+bwd ms':<26} {'TF/s':>7} {'%peak':>6} {'mem GB':>7} {'syncs':>5}"]
    for layer in result["layer"]:
        for i, (path, r) in enumerate(layer["paths"].items()):
            name = layer["shape"]["name"] if i == 0 else ""
            lines.append(f"{name:<26} {path:<8} {_ms(r['forward']):<26} {r['tflops_forward']:>7.1f} "
                         f"{_num(r.get('percent_of_peak_forward'), '.1f'):>6}  {_ms(r['forward_backward']):<26} "
                         f"{r['tflops_forward_backward']:>7.1f} {_num(r.get('percent_of_peak_forward_backward'), '.1f'):>6} "
                         f"{_num(r['peak_memory_gb'], '.2f'):>7} {r['host_syncs_forward_backward']:>5}")
        check = layer["check"]
        lines.append(f"{'':<26} grouped vs loop: max relative error {check['max_relative_error']:.2e} "
                     f"(tolerance {check['tolerance']:.0e}): {'equal' if check['equal'] else 'DIFFERENT'}")
    return lines


def _attention_lines(result: dict) -> list:
    lines = [f"{'attention':<24} {'backend':<8} {'kernel':<18} {'forward ms':<26} {'TF/s':>7} "
             f"{'fwd+bwd ms':<26} {'TF/s':>7} {'%peak':>6} {'rel err':>8}"]
    for item in result["attention"]:
        for i, (backend, r) in enumerate(item["backends"].items()):
            name = item["shape"]["name"] if i == 0 else ""
            lines.append(f"{name:<24} {backend:<8} {r['kernel']:<18} {_ms(r['forward']):<26} {r['tflops_forward']:>7.1f} "
                         f"{_ms(r['forward_backward']):<26} {r['tflops_forward_backward']:>7.1f} "
                         f"{_num(r.get('percent_of_peak_forward_backward'), '.1f'):>6} "
                         f"{r['relative_error_vs_first']:>8.1e}")
    return lines


def _train_lines(result: dict) -> list:
    lines = [f"{'training step':<34} {'arm':<6} {'layers':>6} {'step ms':<30} {'tokens/s':>10} {'TF/s':>7} "
             f"{'MFU':>6} {'mem GB':>7} {'loss':>7}"]
    for name, item in result["train"].items():
        for i, (arm, r) in enumerate(item["arms"].items()):
            label = name if i == 0 else ""
            if "out_of_memory" in r:
                lines.append(f"{label:<34} {arm:<6} out of memory: {r['out_of_memory']}")
                continue
            lines.append(f"{label:<34} {arm:<6} {r['num_layers']:>6} {_ms(r['step_time']):<30} {r['tokens_per_s']:>10.0f} "
                         f"{r['tflops']:>7.1f} {_num(r['mfu'] and 100 * r['mfu'], '.1f'):>6} "
                         f"{_num(r['peak_memory_gb'], '.2f'):>7} {r['first_loss']:>7.3f}")
        for arm, check in item.get("check", {}).items():
            lines.append(f"{'':<34} first-step loss {arm} vs {REFERENCE_ARM}: relative error "
                         f"{check['first_loss_relative_error']:.2e} (tolerance {check['tolerance']:.0e}): "
                         f"{'equal' if check['equal'] else 'DIFFERENT'}")
        for pair, ratio in item.get("ratios", {}).items():
            from tools.bench.discipline import interval_name

            lines.append(f"{'':<34} step time {pair}: {ratio['median']:.2f}x [{ratio['ci_low']:.2f}-"
                         f"{ratio['ci_high']:.2f}] ({interval_name(ratio['n'], unit='round')})")
        if "layers_note" in item:
            lines.append(f"{'':<34} {item['layers_note']}")
        for arm, r in item["arms"].items():
            if "breakdown" in r:
                shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(r["breakdown"]["shares"].items(),
                                                                            key=lambda kv: -kv[1]) if v >= 0.005)
                lines.append(f"{'':<34} where the {arm} step goes ({r['breakdown']['kind']}): {shares}")
    return lines


def format_table(result: dict) -> str:
    """The human-readable summary of ``run``'s result."""
    env = result["environment"]
    lines = [f"device {env['device']} (peak {_num(env['peak_tflops'], '.1f')} TFLOP/s bf16 dense), torch "
             f"{env['torch']}, CUDA {env['cuda']}, megatron-core {env['megatron_core']}; times: median "
             "(min-max, n) ms"]
    if result["layer"]:
        lines += _layer_lines(result)
    if result["attention"]:
        lines += _attention_lines(result)
    if result["train"]:
        lines += _train_lines(result)
    if result.get("serving"):
        from tools.bench import gpu_serving

        serving = result["serving"]
        if serving["schema"] == gpu_serving.RATIO_SCHEMA:
            lines += [gpu_serving.decode_ratio_line(serving["batch"], m) for m in serving["models"]]
        else:
            lines.append(gpu_serving.format_table(serving))
    if result["variants"]:
        lines.append(f"{'variant (grouped, auto)':<34} {'step ms':<30} {'tokens/s':>10} {'MFU':>6} "
                     f"{f'a2a MiB/step at EP={A2A_EP}':>20}")
        for v in result["variants"]:
            lines.append(f"{v['variant']:<34} {_ms(v['step_time']):<30} {v['tokens_per_s']:>10.0f} "
                         f"{_num(v['mfu'] and 100 * v['mfu'], '.1f'):>6} "
                         f"{v[f'a2a_bytes_per_step_ep{A2A_EP}_computed'] / 2**20:>20.1f}")
    for skipped in result["skipped"]:
        lines.append(f"skipped {skipped['item']}: {skipped['reason']}")
    lines.append(f"total {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="gpu (the default on a GPU), cpu (the same-run CPU ratios) or cpu-smoke (toy sizes, "
                             "the default on a CPU)")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)})")
    parser.add_argument("--time-budget-s", type=positive_float, default=570.0,
                        help="skip the items that would end later than this many seconds after the start (default 570)")
    parser.add_argument("--peak-tflops", type=positive_float, default=None,
                        help="the device's dense bf16 peak for percentages and MFU (default: known GPUs')")
    parser.add_argument("--out", default=None, help="JSON output (default runs/bench_gpu_<preset>.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--iters", type=positive_int, default=None, help="timed repetitions (default: the preset's)")
    return parser


def main(argv=None) -> int:
    start = time.monotonic()

    def body():
        import torch

        from megatron import compat
        from megatron.common.files import refuse_existing, write_json

        args = _parser().parse_args(argv)
        preset = args.preset or ("gpu" if torch.cuda.is_available() else "cpu-smoke")
        sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
        with user_input():
            unknown = sorted(set(sections) - set(SECTIONS))
            if unknown:
                raise ValueError(f"--sections: unknown section(s) {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
            if preset == "gpu" and not torch.cuda.is_available():
                raise ValueError("--preset gpu needs a CUDA GPU; use --preset cpu or cpu-smoke on a CPU")
            out_path = args.out or os.path.join("runs", f"bench_gpu_{preset}.json")
            refuse_existing(out_path, "--out", args.overwrite)
        compat.quiet_warnings()
        result = run(preset, sections=sections, time_budget_s=args.time_budget_s, peak_tflops=args.peak_tflops,
                     iters=args.iters, start=start)
        write_json(out_path, result)
        print(format_table(result), flush=True)
        print(f"wrote {out_path}", flush=True)

    return run_cli("python -m tools.bench.gpu", body, user_errors=(UserError,))


if __name__ == "__main__":
    sys.exit(main())
