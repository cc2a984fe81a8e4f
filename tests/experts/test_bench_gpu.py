"""``python -m tools.bench.gpu`` at toy sizes on the CPU (``--preset cpu-smoke``): the JSON's schema,
the grouped-vs-loop checks it ran, the time budget and the command line's errors.

No timing is asserted (CPU timings are not meaningful); the checks inside the benchmark compare
grouped and loop in fp32, where they agree exactly (``test_grouped_equivalence``), against their
stated tolerances. The runs happen in a forked process (``run_distributed(fn, 1)``, which the
benchmark's own one-rank world then reuses): megatron-core's process groups are never created in
the test process, whose later forks would inherit them half torn down.
"""

import json

import pytest

from tools.bench import gpu
from tools.spawn import run_distributed

TIMING = {"median_s", "min_s", "max_s", "n"}
LAYER_PATH = {"forward", "forward_backward", "tflops_forward", "tflops_forward_backward", "peak_memory_gb",
              "host_syncs_forward_backward"}
TRAIN = {"experts", "parameters", "active_weights_per_token", "flops_per_token", "tokens_per_step", "step_time",
         "tokens_per_s", "tflops", "mfu", "peak_memory_gb", "first_loss", "last_loss", "a2a_bytes_per_step_measured",
         f"a2a_bytes_per_step_ep{gpu.A2A_EP}_computed", "wall_s"}


def test_cpu_smoke_run_writes_the_schema_and_checks_grouped_against_the_loop(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--preset", "cpu-smoke", "--out", str(out), "--time-budget-s", "600"]
    assert run_distributed(lambda rank, world: gpu.main(argv), 1, timeout_s=300) == [0]
    result = json.loads(out.read_text())
    assert result["schema"] == gpu.SCHEMA and result["preset"] == "cpu-smoke" and result["skipped"] == []
    env = result["environment"]
    assert env["device"] == "cpu" and env["peak_tflops"] is None and env["torch"] and env["megatron_core"] == "0.16.1"
    assert len(result["layer"]) == len(gpu.PRESETS["cpu-smoke"].layers)
    for layer in result["layer"]:
        assert layer["check"]["equal"] and layer["check"]["max_relative_error"] <= layer["check"]["tolerance"]
        assert set(layer["check"]["relative_errors"]) == {"output", "input grad", "probs grad", "weight grads"}
        assert set(layer["paths"]) == {"grouped", "loop"}
        for path in layer["paths"].values():
            assert LAYER_PATH <= set(path) and TIMING == set(path["forward"]) == set(path["forward_backward"])
        assert layer["paths"]["grouped"]["host_syncs_forward_backward"] == 0
        assert layer["paths"]["loop"]["host_syncs_forward_backward"] == 1
    train = result["train"]
    assert train["check"]["equal"]
    for path in ("grouped", "loop"):
        assert TRAIN <= set(train[path]) and TIMING == set(train[path]["step_time"])
        assert train[path]["a2a_bytes_per_step_measured"] == 0  # EP = 1
        # top-2 of 8 experts: far fewer weights per token than the model holds (all 8 counted: 4x too many)
        assert train[path]["active_weights_per_token"] < 0.6 * train[path]["parameters"]
    assert train["grouped"]["experts"].startswith("grouped GEMM") and train["loop"]["experts"].startswith("SequentialMLP")
    [variant] = result["variants"]  # every registered variant with its own MoE layer (today one)
    assert TRAIN <= set(variant) and variant["experts"].startswith("grouped GEMM")
    # a lower-dimensional dispatch moves fewer bytes than the standard layer's
    key = f"a2a_bytes_per_step_ep{gpu.A2A_EP}_computed"
    assert 0 < variant[key] < train["grouped"][key]
    table = gpu.format_table(result)
    assert "grouped vs loop: max relative error" in table and "first-step loss grouped vs loop" in table
    # the all-to-all column divides by 2**20: MiB, and the table says so
    assert f"a2a MiB/step at EP={gpu.A2A_EP}" in table and "MB/step" not in table
    assert f"{train['grouped'][key] / 2**20:.1f}" in table


def test_items_past_the_time_budget_are_skipped_and_listed():
    [result] = run_distributed(lambda rank, world: gpu.run("cpu-smoke", sections=("layer", "train"),
                                                           time_budget_s=0.5), 1, timeout_s=120)
    assert result["layer"] == [] and result["train"] == {}
    items = [s["item"] for s in result["skipped"]]
    assert items == [f"layer {s.name}" for s in gpu.PRESETS["cpu-smoke"].layers] + ["train grouped", "train loop"]
    assert all(s["reason"].startswith("time budget") for s in result["skipped"])
    assert "skipped train loop: time budget" in gpu.format_table(result)


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
