"""``tools/bench/gpu_serving.py`` at toy sizes on the CPU: the JSON's schema, the bounds' arithmetic,
the routed-expert count, the host syncs per decode step of each attention path, the decode ratio's
schema and the command line's errors.

No timing is asserted. The bounds are computed with a stated peak and bandwidth (a CPU has neither):
the fraction of the bound must be the bound's seconds over the measured median, exactly as
documented. One token routed top-k reaches exactly k distinct experts in each MoE layer, so a
batch-1 decode step's routed-expert count is k x the MoE layers. The loop path reads each layer's
key lengths on the host once (its ``tolist``), the batched path never: per decode step the loop makes
exactly L (layers) more host syncs. The runs happen in a forked process (``run_distributed``); the
two that serve models are marked slow.
"""

import json

import pytest

from tools.bench import gpu_serving
from tools.spawn import run_distributed

TIMING = {"median_s", "min_s", "max_s", "n"}


def _measure(rank, world):
    return gpu_serving.run("cpu-smoke", iters=1, peak_tflops=2.0, bandwidth_tb_s=0.5)


@pytest.mark.slow  # two models served through both paths (~25 s)
def test_cpu_smoke_measures_both_paths_against_their_bounds():
    [result] = run_distributed(_measure, 1, timeout_s=300)
    preset = gpu_serving.PRESETS["cpu-smoke"]
    assert result["schema"] == gpu_serving.SCHEMA and result["environment"]["device"] == "cpu"
    assert [m["name"] for m in result["models"]] == [m.name for m in preset.models]
    for model in result["models"]:
        layers, topk = model["layers"], model["model"]["moe_router_topk"]
        assert set(model["paths"]) == {"loop", "batched"}
        for path, rows in model["paths"].items():
            assert rows["kernels"]["paged_attention"] == path and rows["kernels"]["attention_kernels"] == "torch"
            assert [r["batch"] for r in rows["prefill"]] == [r["batch"] for r in rows["decode"]] == list(preset.batches)
            for row in rows["prefill"]:
                assert set(row["time"]) == TIMING and row["tokens"] == row["batch"] * preset.prompt_tokens
                seconds = row["flops"] / 2.0e12
                assert row["fraction_of_bound"] == pytest.approx(seconds / row["time"]["median_s"])
                assert row["bound_tokens_per_s"] == pytest.approx(row["tokens"] / seconds)
            for row in rows["decode"]:
                seconds = row["bytes_per_step"] / 0.5e12
                assert row["fraction_of_bound"] == pytest.approx(seconds / row["time"]["median_s"])
                assert row["bytes_per_step"] > model["weights"]["dense_bytes"] + row["kv_cache_bytes_per_step"]
                kv_bytes = row["batch"] * row["mean_context"] * model["weights"]["kv_cache_bytes_per_token"]
                assert row["kv_cache_bytes_per_step"] == pytest.approx(kv_bytes)
                assert row["mean_context"] > preset.decode_context
            assert rows["decode"][0]["batch"] == 1 and rows["decode"][0]["routed_experts_per_step"] == topk * (layers - 1)
        loop, batched = model["paths"]["loop"]["decode"], model["paths"]["batched"]["decode"]
        assert [a["host_syncs_per_step"] - b["host_syncs_per_step"] for a, b in zip(loop, batched)] == \
            [layers] * len(loop)
    table = gpu_serving.format_table(result)
    assert "toy MLA (2 layers)" in table and "batched  decode" in table


@pytest.mark.slow  # two models served (~15 s)
def test_decode_ratio_interleaves_the_paths():
    [result] = run_distributed(lambda rank, world: gpu_serving.decode_ratio(batch=4, context=8, repeats=2, warmup=1),
                               1, timeout_s=300)
    assert result["schema"] == gpu_serving.RATIO_SCHEMA and result["batch"] == 4
    for model in result["models"]:
        assert set(model["step_s"]) == {"loop", "batched"} and all(t["n"] == 2 for t in model["step_s"].values())
        ratio = model["ratio_loop_over_batched"]
        assert ratio["n"] == 2 and ratio["ci_low"] <= ratio["median"] <= ratio["ci_high"] and ratio["interval_kind"] == "range"


def test_gpu_preset_on_a_cpu_is_one_line(capsys, tmp_path):
    assert gpu_serving.main(["--preset", "gpu", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m tools.bench.gpu_serving: error: --preset gpu needs a CUDA GPU")


def test_an_existing_output_is_refused(capsys, tmp_path):
    out = tmp_path / "x.json"
    out.write_text(json.dumps({}))
    assert gpu_serving.main(["--preset", "cpu-smoke", "--out", str(out)]) == 2
    assert "exists (pass --overwrite to replace it)" in capsys.readouterr().err
