"""The FCSD report (held-out rows for teacher / untrained conversion / students, unigram floor)
and the sweep's selection logic (distill/sweep.py)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from distill.report import format_table, unigram_perplexity

from distill import sweep

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# end-to-end runs of python -m distill.report on trained checkpoints
pytestmark = pytest.mark.slow


def _report(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "distill.report", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unigram_perplexity_by_hand():
    counts = np.array([3, 0, 1])  # add-one: 4/7, 1/7, 2/7
    got = unigram_perplexity(counts, np.array([0, 2, 2]))
    expected = -(math.log(4 / 7) + 2 * math.log(2 / 7)) / 3
    assert got["loss"] == pytest.approx(expected, rel=1e-12) and got["ppl"] == pytest.approx(math.exp(expected))


def test_report_rows(teacher_ckpt, tmp_path):
    """Teacher: KL 0 to itself; the same checkpoint as a 'student' reproduces the teacher row
    exactly; the untrained FarSkip conversion changes the function (KL > 0)."""
    from megatron.components.tokenizer import DEFAULT_CORPUS

    out = tmp_path / "report.json"
    proc = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", out,
                   "--untrained", "all", "--student", f"same={teacher_ckpt / 'teacher'}", "--max-windows", 6,
                   "--micro-batch-size", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    teacher, same, untrained = rows["teacher"], rows["same"], rows["untrained, farskip all"]
    assert teacher["kl_to_teacher"] == pytest.approx(0.0, abs=1e-6) and teacher["ppl_gap_to_teacher"] == 0
    assert same["loss"] == teacher["loss"]  # same weights, same connectivity: bit-identical
    # a 4-step teacher is close to its random init, so the change is small but far above fp32 noise
    assert untrained["kl_to_teacher"] > 1e-6 and untrained["loss"] != teacher["loss"] and untrained["farskip"] == "all"
    assert "| teacher |" in proc.stdout and "| untrained, farskip all | all |" in format_table(list(rows.values()))


def test_untrained_sub_block_conversions(teacher_ckpt, tmp_path, capsys):
    """``SPEC@MODE``: ``last:1@mlp-only`` feeds the MoE the pre-attention residual and changes the
    function. ``last:1@attn-only`` changes it too (the MoE layer before hands the last attention its
    routed-free stream, the reference connectivity), but with ``--farskip-connectivity paper-text``
    that layer hands on its full output and the conversion is the teacher's function (KL 0 up to
    rounding). A bad
    mode or layer spec is a one-line error before any model is loaded."""
    from distill.report import main as report_main
    from megatron.components.tokenizer import DEFAULT_CORPUS

    rows = {}
    for connectivity in ("reference", "paper-text"):
        out = tmp_path / f"report_{connectivity}.json"
        proc = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", out,
                       "--untrained", "last:1@attn-only", "--untrained", "last:1@mlp-only", "--max-windows", 6,
                       "--micro-batch-size", 4, "--farskip-connectivity", connectivity)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[connectivity] = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    for connectivity, by_model in rows.items():
        attn, mlp = by_model["untrained, farskip last:1@attn-only"], by_model["untrained, farskip last:1@mlp-only"]
        assert attn["farskip"] == "last:1" and attn["farskip_mode"] == "attn-only"
        assert attn["farskip_connectivity"] == connectivity
        assert mlp["kl_to_teacher"] > 1e-6 and mlp["farskip_mode"] == "mlp-only"
    attn_kl = {c: by_model["untrained, farskip last:1@attn-only"]["kl_to_teacher"] for c, by_model in rows.items()}
    mlp_kl = {c: by_model["untrained, farskip last:1@mlp-only"]["kl_to_teacher"] for c, by_model in rows.items()}
    # paper-text: the teacher's function up to the order of two additions (measured 2e-9); reference 4e-6
    assert attn_kl["paper-text"] == pytest.approx(0.0, abs=1e-7) and attn_kl["reference"] > 1e-6
    assert mlp_kl["reference"] == mlp_kl["paper-text"]  # mlp-only: no lead-in, the same wiring
    for bad, says in (("last:1@sideways", "unknown FarSkip mode 'sideways'"), ("middle:2", "middle:2")):
        assert report_main(["--teacher", str(teacher_ckpt / "teacher"), "--text", DEFAULT_CORPUS,
                            "--out", str(tmp_path / "bad.json"), "--untrained", bad]) == 2  # fmt: skip
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad.json").exists()


def test_student_rows_record_their_wiring(teacher_ckpt, tmp_path):
    """A student row carries the FarSkip wiring its checkpoint was trained with
    (``farskip_connectivity``), so reports of both wirings side by side say which row is which:
    a 1-step ``last:1`` student trained with ``paper-text`` and one with the default."""
    from megatron.components.tokenizer import DEFAULT_CORPUS
    from tests.distill.conftest import fcsd_args
    from tests.helpers import torchrun

    students = []
    for wiring in ("paper-text", None):
        out = tmp_path / f"student_{wiring or 'default'}"
        args = fcsd_args(teacher_ckpt, out) + ["--farskip", "last:1", "--train-iters", 1, "--eval-interval", 1]
        proc = torchrun("distill.fcsd", args + (["--farskip-connectivity", wiring] if wiring else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
        students += ["--student", f"{wiring or 'default'}={out / 'best'}"]
    report = tmp_path / "report.json"
    proc = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", report, *students,
                   "--max-windows", 2, "--micro-batch-size", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["paper-text"]["farskip_connectivity"] == "paper-text" and rows["paper-text"]["farskip"] == "last:1"
    assert rows["default"]["farskip_connectivity"] == "reference"


def test_report_lm_eval_columns(teacher_ckpt, tmp_path):
    """``--lm-eval-tasks``: every row gets the task's scores through the adapter; the same weights
    score the same, and the table shows the main metric as a column."""
    pytest.importorskip("lm_eval")
    from megatron.components.tokenizer import DEFAULT_CORPUS
    from tests.helpers import write_arc_easy

    out = tmp_path / "report.json"
    proc = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", out,
                   "--untrained", "all", "--student", f"same={teacher_ckpt / 'teacher'}", "--max-windows", 2,
                   "--lm-eval-tasks", "local_arc_easy", "--include-path", os.path.join(REPO, "examples", "lm_eval_tasks"),
                   "--data-dir", write_arc_easy(tmp_path / "data"), "--lm-eval-limit", 5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert 0.0 <= r["lm_eval"]["local_arc_easy"]["acc,none"] <= 1.0
    assert rows["same"]["lm_eval"] == rows["teacher"]["lm_eval"]
    assert "| local_arc_easy acc_norm |" in proc.stdout
    bad = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", tmp_path / "b.json",
                  "--lm-eval-tasks", "no_such_task", "--include-path", os.path.join(REPO, "examples", "lm_eval_tasks"))
    assert bad.returncode == 2 and "unknown task 'no_such_task'" in bad.stderr and not (tmp_path / "b.json").exists()
    meta = json.loads(out.read_text())["lm_eval"]
    assert meta["tasks"] == ["local_arc_easy"] and meta["higher_is_better"]["local_arc_easy"]["acc"] is True
    missing = _report("--teacher", teacher_ckpt / "teacher", "--text", DEFAULT_CORPUS, "--out", tmp_path / "b.json",
                      "--lm-eval-tasks", "local_piqa", "--include-path", os.path.join(REPO, "examples", "lm_eval_tasks"),
                      "--data-dir", tmp_path / "data")  # no eval/piqa there: fails before any model loads
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0 and "no such file" in missing.stderr
    assert not (tmp_path / "b.json").exists()


def test_report_bad_input(tmp_path):
    out = tmp_path / "r.json"
    proc = _report("--teacher", tmp_path / "missing", "--text", __file__, "--out", out)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "missing" in proc.stderr
    proc = _report("--teacher", tmp_path, "--text", __file__, "--out", out, "--student", "nolabel")
    assert proc.returncode == 2 and "LABEL=CHECKPOINT" in proc.stderr
    assert not out.exists()


def test_sweep_training_loss_and_batch(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": i, "loss": float(10 - i)} for i in range(1, 7)]
    records.insert(3, {"event": "valid", "step": 3, "loss": 99.0})  # evaluations are not training steps
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert sweep.training_loss(str(path), 2) == (pytest.approx(4.5), False)
    with open(path, "a") as f:
        f.write(json.dumps({"event": "summary", "step": 6}) + "\n")
    kd = tmp_path / "kd.jsonl"  # distillation runs are selected by their distillation loss
    kd.write_text(json.dumps({"step": 1, "loss": 5.0, "kd_loss": 0.25}) + "\n")
    assert sweep.training_loss(str(kd), 1)[0] == 0.25
    assert sweep.training_loss(str(path), 3)[1] is True
    assert sweep.global_batch_size(4096, 128, 4, 2) == 32
    with pytest.raises(ValueError, match="multiple"):
        sweep.global_batch_size(1000, 128, 4, 2)


def test_sweep_bad_input(tmp_path, capsys):
    assert sweep.main(["--load", str(tmp_path / "none"), "--root", str(tmp_path / "s")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
