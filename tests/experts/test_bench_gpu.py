"""``python -m tools.bench.gpu`` at toy sizes on the CPU (``--preset cpu-smoke``): the JSON's schema,
the checks it ran (grouped experts against the loop, each attention backend against megatron-core's
``DotProductAttention``, the fast training arm's first loss against the reference arm's), the step
breakdown, the time budget and the command line's errors.

No timing is asserted (CPU timings are not meaningful); the checks inside the benchmark compare
fp32 paths against their stated tolerances (grouped and loop agree exactly,
``test_grouped_equivalence``; the attention kernels within 1e-6, ``tests/attention``). The runs happen in a forked process (``run_distributed(fn, 1)``, which the
benchmark's own one-rank world then reuses): megatron-core's process groups are never created in
the test process, whose later forks would inherit them half torn down.
"""

import json

import pytest

from tools.bench import gpu
from tools.bench.breakdown import CATEGORIES as BREAKDOWN
from tools.spawn import run_distributed

TIMING = {"median_s", "min_s", "max_s", "n"}
LAYER_PATH = {"forward", "forward_backward", "tflops_forward", "tflops_forward_backward", "peak_memory_gb",
              "host_syncs_forward_backward"}
TRAIN = {"num_layers", "attention", "experts", "parameters", "active_weights_per_token", "flops_per_token",
         "tokens_per_step", "step_time", "tokens_per_s", "tflops", "mfu", "peak_memory_gb", "first_loss", "last_loss",
         "a2a_bytes_per_step_measured", f"a2a_bytes_per_step_ep{gpu.A2A_EP}_computed"}
ATTENTION = {"forward", "forward_backward", "tflops_forward", "tflops_forward_backward", "kernel",
             "relative_error_vs_first", "peak_memory_gb"}


def test_cpu_smoke_run_writes_the_schema_and_checks_its_paths_against_their_references(tmp_path):
    out = tmp_path / "bench.json"
    sections = "layer,attention,train,breakdown,variants"
    argv = ["--preset", "cpu-smoke", "--out", str(out), "--time-budget-s", "600", "--sections", sections]
    assert run_distributed(lambda rank, world: gpu.main(argv), 1, timeout_s=300) == [0]
    result = json.loads(out.read_text())
    assert result["schema"] == gpu.SCHEMA and result["preset"] == "cpu-smoke" and result["skipped"] == []
    env = result["environment"]
    assert env["device"] == "cpu" and env["peak_tflops"] is None and env["torch"] and env["megatron_core"] == "0.16.1"
    preset = gpu.PRESETS["cpu-smoke"]
    assert len(result["layer"]) == len(preset.layers)
    for layer in result["layer"]:
        assert layer["check"]["equal"] and layer["check"]["max_relative_error"] <= layer["check"]["tolerance"]
        assert set(layer["check"]["relative_errors"]) == {"output", "input grad", "probs grad", "weight grads"}
        assert set(layer["paths"]) == {"grouped", "loop"}
        for path in layer["paths"].values():
            assert LAYER_PATH <= set(path) and TIMING == set(path["forward"]) == set(path["forward_backward"])
        assert layer["paths"]["grouped"]["host_syncs_forward_backward"] == 0
        assert layer["paths"]["loop"]["host_syncs_forward_backward"] == 1
    # attention: every backend of the preset, each output against the reference's (fp32)
    assert [a["shape"]["name"] for a in result["attention"]] == [s.name for s in preset.attention]
    for item in result["attention"]:
        assert list(item["backends"]) == list(preset.attention_backends)
        for backend, r in item["backends"].items():
            assert ATTENTION <= set(r) and r["relative_error_vs_first"] <= 1e-6
        assert item["backends"]["auto"]["kernel"] == "flash" and item["backends"]["unfused"]["kernel"] == "math"
    # training: each model with the reference and the fast attention, the same first loss
    assert list(result["train"]) == [s.name for s in preset.train]
    for item in result["train"].values():
        assert set(item["arms"]) == {"local", "auto"} and item["check"]["auto"]["equal"]
        for arm, r in item["arms"].items():
            assert TRAIN <= set(r) and TIMING == set(r["step_time"]) and r["a2a_bytes_per_step_measured"] == 0
            # top-2 of 8 experts: far fewer weights per token than the model holds (all 8 counted: 4x too many)
            assert r["active_weights_per_token"] < 0.6 * r["parameters"]
            assert r["experts"].startswith("grouped GEMM")
        assert item["arms"]["local"]["attention"].startswith("megatron-core DotProductAttention")
        assert item["arms"]["auto"]["attention"].startswith("torch scaled_dot_product_attention, flash kernel")
        # the breakdown runs in the fast arm: every category, shares of the step summing to 1
        breakdown = item["arms"]["auto"]["breakdown"]
        assert set(breakdown["seconds"]) == set(BREAKDOWN) | {"idle"} and "breakdown" not in item["arms"]["local"]
        assert abs(sum(breakdown["shares"].values()) - 1) < 1e-9
        assert breakdown["seconds"]["attention"] > 0 and breakdown["seconds"]["expert GEMMs"] > 0
    [variant] = result["variants"]  # every registered variant with its own MoE layer (today one)
    assert TRAIN <= set(variant) and variant["experts"].startswith("grouped GEMM")
    # a lower-dimensional dispatch moves fewer bytes than the standard layer's
    key = f"a2a_bytes_per_step_ep{gpu.A2A_EP}_computed"
    standard = result["train"][variant["model"]]["arms"]["auto"]
    assert 0 < variant[key] < standard[key]
    table = gpu.format_table(result)
    assert "grouped vs loop: max relative error" in table and "first-step loss auto vs local" in table
    assert "where the auto step goes" in table
    # the all-to-all column divides by 2**20: MiB, and the table says so
    assert f"a2a MiB/step at EP={gpu.A2A_EP}" in table and "MB/step" not in table
    assert f"{variant[key] / 2**20:.1f}" in table


def test_items_past_the_time_budget_are_skipped_and_listed():
    [result] = run_distributed(lambda rank, world: gpu.run("cpu-smoke", sections=("layer", "train"),
                                                           time_budget_s=0.5), 1, timeout_s=120)
    assert result["layer"] == [] and result["train"] == {}
    items = [s["item"] for s in result["skipped"]]
    preset = gpu.PRESETS["cpu-smoke"]
    assert items == [f"layer {s.name}" for s in preset.layers] + [f"train {s.name}" for s in preset.train]
    assert all(s["reason"].startswith("time budget") for s in result["skipped"])
    assert f"skipped train {preset.train[-1].name}: time budget" in gpu.format_table(result)


@pytest.mark.parametrize("argv,message", [
    (["--sections", "layer,nope"], "--sections: unknown section(s) nope"),
    (["--preset", "gpu"], "--preset gpu needs a CUDA GPU"),
])
def test_bad_input_is_one_line(argv, message, capsys, tmp_path):
    assert gpu.main(argv + ["--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m tools.bench.gpu: error: {err[0].split('error: ', 1)[1]}"] and message in err[0]


def test_an_existing_output_is_refused(tmp_path, capsys):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    assert gpu.main(["--preset", "cpu-smoke", "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == "{}"


@pytest.mark.slow
def test_the_serving_section_runs_the_servers_engine(tmp_path):
    """The serving section at toy size: ``tools/bench/gpu_serving.py``'s result for each paged-attention
    path under the bench's JSON, and its table in the bench's (the measurements themselves are
    tested in ``tests/serving/test_bench_gpu_serving.py``)."""
    out = tmp_path / "bench.json"
    argv = ["--preset", "cpu-smoke", "--out", str(out), "--sections", "serving", "--time-budget-s", "600"]
    assert run_distributed(lambda rank, world: gpu.main(argv), 1, timeout_s=300) == [0]
    result = json.loads(out.read_text())
    serving = result["serving"]
    assert serving["schema"] == "bench_gpu_serving/1" and serving["models"]
    for model in serving["models"]:
        assert set(model["paths"]) == {"loop", "batched"}
        assert all(row["host_syncs_per_step"] >= 0 for row in model["paths"]["batched"]["decode"])
    assert result["skipped"] == [] and "decode" in gpu.format_table(result)


def test_arms_timed_in_turns_give_a_ratio_over_the_rounds():
    """The CPU preset's way of timing (``measure_training_interleaved``), at toy size: every arm's
    record, the ratio of the reference arm's step time to the other's as a median with its interval
    kind over the rounds, the same first loss, and the breakdown of the named arm."""
    from tools.bench.gpu_measure import measure_training_interleaved

    shape = gpu.PRESETS["cpu-smoke"].train[0]
    [result] = run_distributed(lambda rank, world: measure_training_interleaved(
        shape, dict(gpu.PRESETS["cpu-smoke"].arms), warmup=1, iters=1, rounds=2, peak_tflops=None, a2a_ep=8,
        breakdown_arm="auto", breakdown_steps=1), 1, timeout_s=300)
    assert set(result["variants"]) == {"local", "auto"} and result["rounds"] == 2
    assert result["variants"]["local"]["first_loss"] == result["variants"]["auto"]["first_loss"]
    ratio = result["step_time_ratios"]["local/auto"]
    assert ratio["n"] == 2 and ratio["interval_kind"] == "range" and ratio["ci_low"] <= ratio["median"] <= ratio["ci_high"]
    assert "breakdown" in result["variants"]["auto"] and "breakdown" not in result["variants"]["local"]
