"""``python -m tools.bench.gpu``: how fast the routed experts and a training step run on one GPU.

Three sections, each the grouped-GEMM experts against megatron-core's ``SequentialMLP`` loop
(``moe_variants/common/experts.py``), run in one process on the current GPU (NCCL world of one
rank) or, for CI, on the CPU at toy sizes (``--preset cpu-smoke``, gloo):

- ``layer``: one MoE layer's routed experts, forward and forward+backward, at Qwen3-30B-A3B's
  layer (hidden 2048, expert FFN 768, SwiGLU, 128 experts, top-8, 32k tokens) and at the routed
  experts of our DeepSeek-V2-Lite layout (``examples/deepseek_v2_lite.yaml``: 2048, 1408, 64
  experts, top-6; the shared experts are a dense MLP either way and left out): TFLOP/s from the
  counted FLOPs, percent of the device's dense bf16 peak, peak memory, host syncs, and the grouped
  output and gradients checked against the loop's;
- ``train``: end-to-end training steps of a ~1.3B-parameter fine-grained MoE (12 layers, hidden
  1024, 64 experts of FFN 512, top-8) at sequence 4096, EP = 1, bf16, through the project's
  ``setup_model_and_optimizer`` and ``train_step``: tokens/s and MFU (``megatron/training/flops.py``);
- ``variants``: every registered variant that replaces the MoE layer, trained like ``train`` on the
  grouped path, against the standard layer: step time and the all-to-all bytes per step. At EP = 1
  no all-to-all runs (the counters read 0); the bytes are computed from the built layers' widths for
  EP = 8 under uniform routing.

Times are medians of repeated runs after a warm-up, with min and max (``gpu_measure.timed``).
``--time-budget-s`` (default 300 s from the start) skips the items that would not fit, says which,
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
from tools.bench.gpu_measure import LayerShape, TrainShape

__all__ = ["PRESETS", "Preset", "run", "format_table", "main", "SCHEMA"]

SCHEMA = "bench_gpu/1"
SECTIONS = ("layer", "train", "variants")
A2A_EP = 8  # the expert-parallel size the computed all-to-all bytes are for


@dataclasses.dataclass(frozen=True)
class Preset:
    """What one run measures: the layer shapes, the trained model, the repetitions, and the
    seconds each item is expected to take (for ``--time-budget-s``)."""

    layers: tuple
    train: TrainShape
    bf16: bool
    warmup: int
    iters: int
    train_warmup: int
    train_iters: int
    layer_estimate_s: float
    train_estimate_s: float


_FINE_GRAINED_1B = dict(
    num_layers=12, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, seq_length=4096,
    max_position_embeddings=4096, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512, moe_layer_freq=1,
    moe_aux_loss_coeff=1e-3, bf16=True, transformer_impl="local",
)
_TINY = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=64, num_experts=8,
    moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=1, moe_aux_loss_coeff=1e-3, bf16=False,
    transformer_impl="local",
)

PRESETS = {
    "gpu": Preset(
        layers=(LayerShape("qwen3-30b-a3b", 2048, 768, 128, 8, 32768),
                LayerShape("deepseek-v2-lite routed", 2048, 1408, 64, 6, 32768)),
        train=TrainShape("fine-grained MoE 1.3B, seq 4096", _FINE_GRAINED_1B, micro_batch_size=2, vocab_size=32768),
        bf16=True, warmup=3, iters=10, train_warmup=3, train_iters=8, layer_estimate_s=30, train_estimate_s=75,
    ),
    "cpu-smoke": Preset(
        layers=(LayerShape("tiny 8x32", 64, 32, 8, 2, 128),),
        train=TrainShape("tiny MoE, seq 64", _TINY, micro_batch_size=2, vocab_size=256),
        bf16=False, warmup=1, iters=2, train_warmup=1, train_iters=2, layer_estimate_s=2, train_estimate_s=5,
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

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "peak_tflops": peak,
        "peak_note": ("dense bf16 peak of this device (megatron/training/flops.py PEAK_BF16_TFLOPS: H100 and H200 "
                      "SXM 989.4) or --peak-tflops" if peak else "no peak known: percentages and MFU omitted"),
    }


def _log(message: str) -> None:
    print(f"bench_gpu: {message}", file=sys.stderr, flush=True)


def _measure_training_isolated(shape, overrides: dict, **train_args) -> dict:
    """On a GPU every trained model runs in its own process: megatron-core's DDP keeps a model
    alive through the autograd hooks it puts on the parameters (a cycle through C++ that Python's
    collector cannot free), so models trained one after another in one process add up (three
    1.3B models with their Adam states do not fit 80 GB). Its exit returns the memory."""
    import torch

    from megatron.training.parallel import default_backend
    from tools.bench.gpu_measure import measure_training, train_in_child
    from tools.spawn import run_distributed

    if not torch.cuda.is_available():  # the CPU smoke run's toy models: in process
        return measure_training(shape, overrides, **train_args)
    return run_distributed(train_in_child, 1, shape, overrides, train_args, backend=default_backend(),
                           timeout_s=900, num_threads=4)[0]


def run(preset_name: str, *, sections=SECTIONS, time_budget_s: float = 300.0, peak_tflops: Optional[float] = None,
        iters: Optional[int] = None, start: Optional[float] = None) -> dict:
    """Measure ``sections`` of preset ``preset_name`` (``iters`` timed repetitions instead of the
    preset's); the result as a JSON-ready dict."""
    from megatron.training.flops import peak_tflops as device_peak
    from megatron.training.parallel import default_backend, initialize_parallel, single_process_group
    from moe_variants import registry
    from moe_variants.config import ParallelConfig
    from tools.bench.gpu_measure import measure_layer

    preset = PRESETS[preset_name]
    if iters:
        preset = dataclasses.replace(preset, iters=iters, train_iters=iters)
    budget = Budget(time_budget_s, time.monotonic() if start is None else start)
    peak = peak_tflops or device_peak(preset.bf16)
    out = {"schema": SCHEMA, "preset": preset_name, "environment": _environment(peak), "time_budget_s": time_budget_s,
           "layer": [], "train": {}, "variants": [], "skipped": [],
           "flops": {"layer_forward": "2 x tokens x top-k x (hidden x 2 ffn + ffn x hidden) (SwiGLU); "
                                      "forward+backward: 3x",
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
        train_args = dict(warmup=preset.train_warmup, iters=preset.train_iters, peak_tflops=peak, a2a_ep=A2A_EP)
        if "train" in sections:
            for path, grouped in (("grouped", True), ("loop", False)):
                if fits(f"train {path}", preset.train_estimate_s):
                    began = budget.elapsed()
                    result = _measure_training_isolated(preset.train, {"moe_grouped_gemm": grouped}, **train_args)
                    out["train"][path] = {**result, "wall_s": budget.elapsed() - began}
            if {"grouped", "loop"} <= out["train"].keys():
                out["train"]["check"] = _loss_check(out["train"]["grouped"], out["train"]["loop"], preset.bf16)
        if "variants" in sections:
            for variant in registry.variants():
                if variant.moe_layer is None:
                    continue
                if fits(f"variant {variant.name}", preset.train_estimate_s):
                    began = budget.elapsed()
                    result = _measure_training_isolated(preset.train, {"moe_variant": variant.moe_layer,
                                                             "moe_grouped_gemm": True}, **train_args)
                    out["variants"].append({"variant": variant.name, **result, "wall_s": budget.elapsed() - began})
    out["elapsed_s"] = budget.elapsed()
    return out


def _loss_check(grouped: dict, loop: dict, bf16: bool) -> dict:
    """The first step's loss of the two paths (same seed, same data: the same model)."""
    tolerance = 2e-2 if bf16 else 1e-5  # relative; bf16 GEMMs accumulate in different orders
    error = abs(grouped["first_loss"] - loop["first_loss"]) / abs(loop["first_loss"])
    return {"first_loss_relative_error": error, "tolerance": tolerance, "equal": error <= tolerance}


def _ms(timing: dict) -> str:
    return f"{1e3 * timing['median_s']:.2f} ({1e3 * timing['min_s']:.2f}-{1e3 * timing['max_s']:.2f}, n={timing['n']})"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: dict) -> str:
    """The human-readable summary of ``run``'s result."""
    env = result["environment"]
    lines = [f"device {env['device']} (peak {_num(env['peak_tflops'], '.1f')} TFLOP/s bf16 dense), torch "
             f"{env['torch']}, CUDA {env['cuda']}, megatron-core {env['megatron_core']}; times: median "
             "(min-max, n) ms"]
    if result["layer"]:
        lines.append(f"{'expert layer':<26} {'path':<8} {'forward ms':<26} {'TF/s':>7} {'%peak':>6}  "
                     f"{'fwd+bwd ms':<26} {'TF/s':>7} {'%peak':>6} {'mem GB':>7} {'syncs':>5}")
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
    rows = [(path, r) for path, r in result["train"].items() if path != "check"]
    rows += [(f"{v['variant']} (grouped)", v) for v in result["variants"]]
    if rows:
        lines.append(f"{'training step':<26} {'step ms':<30} {'tokens/s':>10} {'TF/s':>7} {'MFU':>6} {'mem GB':>7} "
                     f"{'loss':>7}  {f'a2a MiB/step at EP={A2A_EP}':>20}")
        for path, r in rows:
            lines.append(f"{path:<26} {_ms(r['step_time']):<30} {r['tokens_per_s']:>10.0f} {r['tflops']:>7.1f} "
                         f"{_num(r['mfu'] and 100 * r['mfu'], '.1f'):>6} {_num(r['peak_memory_gb'], '.2f'):>7} "
                         f"{r['first_loss']:>7.3f}  {r[f'a2a_bytes_per_step_ep{A2A_EP}_computed'] / 2**20:>20.1f}")
        if "check" in result["train"]:
            check = result["train"]["check"]
            lines.append(f"first-step loss grouped vs loop: relative error {check['first_loss_relative_error']:.2e} "
                         f"(tolerance {check['tolerance']:.0e}): {'equal' if check['equal'] else 'DIFFERENT'}")
        lines.append(f"all-to-all: none at EP = 1 (measured {rows[0][1]['a2a_bytes_per_step_measured']} bytes); "
                     f"the MiB/step column is computed from the layer widths for EP = {A2A_EP}, uniform routing")
    for skipped in result["skipped"]:
        lines.append(f"skipped {skipped['item']}: {skipped['reason']}")
    lines.append(f"total {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="gpu (the default on a GPU) or cpu-smoke (toy sizes, the default on a CPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--time-budget-s", type=positive_float, default=300.0,
                        help="skip the items that would end later than this many seconds after the start (default 300)")
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
                raise ValueError("--preset gpu needs a CUDA GPU; use --preset cpu-smoke on a CPU")
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
