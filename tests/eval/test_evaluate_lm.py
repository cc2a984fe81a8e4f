"""``python -m megatron.training.evaluate_lm``: one-line errors that write nothing, the offline task
loaders, and one local task end to end (2 ranks, EP=2, against 1 process) on generated data with
the hub unreachable (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``).

End to end, accuracies must be equal and perplexities within rtol 1e-5 (fp32 sums over batches of
different shapes; see test_lm_eval_adapter.py).
"""

import json
import os
import subprocess
import sys

import pytest

try:
    import lm_eval  # noqa: F401
except ImportError:
    pytest.skip('lm-eval is not importable (pip install -e ".[eval]")', allow_module_level=True)

from tests.eval.conftest import REPO  # noqa: E402

TASKS_DIR = os.path.join(REPO, "examples", "lm_eval_tasks")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)


def _run_main(argv, capsys):
    from megatron.training.evaluate_lm import main

    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _args(ckpt, out, **extra):
    argv = ["--load", ckpt, "--output", out]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", v]
    return argv


def _generated_data(root, num_questions=6):
    """A data directory with the shared-data layout: a generated ARC-style file and WikiText lines."""
    from tests.helpers import write_arc_easy

    write_arc_easy(root, num_questions)
    wiki = root / "pretrain" / "wikitext-2-raw"
    wiki.mkdir(parents=True)
    with open(wiki / "wiki.test.raw", "w") as f:
        for title in ("Alpha", "Beta", "Gamma"):
            f.write(f" = {title} = \n")
            f.write(f" {title} is a generated article . It has two lines of text , for a test .\n")
            f.write(" = = Section = = \n")
            f.write(f" The section of {title} ends here .\n")
    return root


@pytest.mark.parametrize("case", ["missing_checkpoint", "unknown_task", "missing_data_dir", "missing_file",
                                  "output_exists", "no_lm_eval"])
def test_bad_input_is_one_line_error_and_writes_nothing(case, ckpt_dir, tmp_path, capsys, monkeypatch):
    """Every bad input, an unknown task included, is reported before the model loads."""
    from megatron.training.lm_eval_adapter import MegatronCheckpointLM

    def no_model(cls, *args, **kwargs):
        pytest.fail("the model was loaded before the bad input was reported")

    monkeypatch.setattr(MegatronCheckpointLM, "from_checkpoint", classmethod(no_model))
    out = tmp_path / "results.json"
    ckpt = ckpt_dir["standard"]
    tasks = dict(tasks="local_arc_easy", include_path=TASKS_DIR, data_dir=_generated_data(tmp_path / "data"))
    expect = {
        "missing_checkpoint": "no such directory",
        # not in --include-path, so lm-eval's whole task index is searched too (the slow case)
        "unknown_task": "unknown task 'local_arc_easy' (the offline local_* tasks need --include-path",
        "missing_data_dir": "--data-dir",
        "missing_file": "no such file",
        "output_exists": "exists",
        "no_lm_eval": 'pip install -e ".[eval]"',
    }[case]
    if case == "missing_checkpoint":
        ckpt = tmp_path / "nope"
    elif case == "unknown_task":
        del tasks["include_path"]
    elif case == "missing_data_dir":
        tasks["data_dir"] = tmp_path / "no_data"
    elif case == "missing_file":
        tasks["tasks"] = "local_piqa"
    elif case == "output_exists":
        out.write_text("keep me")
    elif case == "no_lm_eval":
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` raise ImportError
    code, err = _run_main(_args(ckpt, out, **tasks), capsys)
    assert code == 2
    assert err.startswith("evaluate_lm: error: ") and expect in err, err
    if case == "output_exists":
        assert out.read_text() == "keep me"
    else:
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".results-")] == []


def test_local_task_loaders_read_the_shared_layout(tmp_path):
    sys.path.insert(0, TASKS_DIR)
    try:
        import local_data
    finally:
        sys.path.remove(TASKS_DIR)
    root = _generated_data(tmp_path)
    arc = local_data.arc_easy(data_dir=str(root))["test"]
    assert len(arc) == 6 and arc[1]["question"] == "which is number 1?" and arc[1]["gold"] == 1
    pages = local_data.wikitext(data_dir=str(root))["test"]["page"]
    assert len(pages) == 3  # split at top-level headings only, not at " = = Section = = "
    assert pages[1].startswith(" = Beta = \n") and "Section of Beta" not in pages[0]
    with pytest.raises(ValueError, match="need a data directory"):
        local_data.arc_easy()


def _evaluate(ckpt, out, data, nproc):
    base = ["--load", ckpt, "--tasks", "local_arc_easy,local_wikitext", "--include-path", TASKS_DIR,
            "--data-dir", data, "--limit", 4, "--batch-size", 3, "--bootstrap-iters", 0, "--log-samples",
            "--output", out]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron.training.evaluate_lm", *map(str, base)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               "-m", "megatron.training.evaluate_lm", *map(str, base), "--expert-model-parallel-size", nproc]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **OFFLINE)
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout


@pytest.mark.slow
def test_local_tasks_end_to_end_two_ranks_equal_one(ckpt_dir, tmp_path):
    data = _generated_data(tmp_path / "data")
    two, stdout = _evaluate(ckpt_dir["standard"], tmp_path / "r2.json", data, 2)
    one, _ = _evaluate(ckpt_dir["standard"], tmp_path / "r1.json", data, 1)
    assert "local_arc_easy" in stdout  # the table
    assert two["model"]["world_size"] == 2 and two["model"]["expert_model_parallel_size"] == 2
    assert one["model"]["world_size"] == 1
    arc2, arc1 = two["results"]["local_arc_easy"], one["results"]["local_arc_easy"]
    assert arc2["sample_len"] == 4
    assert arc2["acc,none"] == arc1["acc,none"] and arc2["acc_norm,none"] == arc1["acc_norm,none"]
    # --log-samples: each document's requests and log-likelihoods (one per choice)
    samples2, samples1 = two["samples"]["local_arc_easy"], one["samples"]["local_arc_easy"]
    assert [s["doc_id"] for s in samples2] == [s["doc_id"] for s in samples1] == [0, 1, 2, 3]
    assert [r[0] for s in samples2 for r in s["filtered_resps"]] == pytest.approx(
        [r[0] for s in samples1 for r in s["filtered_resps"]], abs=1e-4)
    assert all(len(s["arguments"]) == len(s["filtered_resps"]) == 4 for s in samples1)
    wiki2, wiki1 = two["results"]["local_wikitext"], one["results"]["local_wikitext"]
    assert wiki2["sample_len"] == 3  # three generated articles (--limit 4)
    assert 1 < wiki2["word_perplexity,none"] < float("inf")
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert wiki2[metric] == pytest.approx(wiki1[metric], rel=1e-5)
    # the local activation rate over the requests' tokens (padding and lockstep dummies not counted)
    assert one["moe"]["lar"] == 1.0 and 0 < two["moe"]["lar"] < 1  # one rank holds every expert
    assert two["moe"]["activations"] == one["moe"]["activations"] > 0
    assert sum(two["moe"]["requests_per_rank"]) == sum(one["moe"]["requests_per_rank"])
    assert two["moe"]["request_scheduling"] == "round-robin" and "local activation rate" in stdout
    assert [p for p in os.listdir(tmp_path) if p.startswith(".results-")] == []


@pytest.mark.parametrize("damage", ["truncated_shard", "crafted_metadata"])
def test_corrupt_or_crafted_checkpoint_is_one_line(damage, ckpt_dir, tmp_path, capsys):
    """A checkpoint that fails its manifest, or whose .metadata would run code, is a one-line
    error (no traceback, nothing written, the payload never runs)."""
    from tests.training.test_reliability import damaged_copy

    ckpt = tmp_path / "ckpt"
    expect = damaged_copy(ckpt_dir["standard"], ckpt, damage, tmp_path / "PWNED")
    out = tmp_path / "results.json"
    tasks = dict(tasks="local_arc_easy", include_path=TASKS_DIR, data_dir=_generated_data(tmp_path / "data"))
    from tools.spawn import run_distributed
    from tests.training.test_reliability import main_in_rank

    argv = [str(a) for a in _args(ckpt, out, **tasks)]
    code, _, err = run_distributed(main_in_rank, 1, "megatron.training.evaluate_lm", argv, timeout_s=240)[0]
    lines = [l for l in err.strip().splitlines() if l.startswith("evaluate_lm: error: ")]
    assert code == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in err, err
    assert not out.exists() and not (tmp_path / "PWNED").exists()


def test_a_bad_newest_checkpoint_names_the_older_one_to_load(ckpt_dir, tmp_path):
    """evaluate_lm has no --load-fallback: the remedy it names is ``--load DIR/iter_N`` of the
    complete checkpoint before the corrupt one (the incomplete case takes the server's path:
    ``tests/serving/test_bad_checkpoint.py``)."""
    from tools.spawn import run_distributed
    from tests.serving.test_bad_checkpoint import damage_newest_beside_an_older
    from tests.training.test_reliability import main_in_rank

    older, expect = damage_newest_beside_an_older(ckpt_dir["standard"], tmp_path / "ckpt", "truncated_shard")
    out = tmp_path / "results.json"
    tasks = dict(tasks="local_arc_easy", include_path=TASKS_DIR, data_dir=_generated_data(tmp_path / "data"))
    argv = [str(a) for a in _args(tmp_path / "ckpt", out, **tasks)]
    code, _, err = run_distributed(main_in_rank, 1, "megatron.training.evaluate_lm", argv, timeout_s=240)[0]
    lines = [l for l in err.strip().splitlines() if l.startswith("evaluate_lm: error: ")]
    assert code == 2 and len(lines) == 1 and expect in lines[0], err
    assert f"load the one before it with --load {older}" in lines[0] and "--load-fallback" not in lines[0], lines[0]
    assert not out.exists()
