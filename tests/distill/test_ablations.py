"""scripts/fcsd_ablations.sh (FarSkip Table 2 + Fig. 3 at demonstration scale) and its table generator.

The script is checked through ``DRY_RUN=1``, which prints every command it would run in order
(nothing is trained): the rows' flags, the rounding of the layer fractions, the skipping of finished
runs (resume), and the one-line refusals of bad settings. scripts/fcsd_demo.sh, which now shares its
data and teacher steps (scripts/fcsd_lib.sh), still plans the same commands. The generator's tables
are checked on a synthetic report.
"""

import json
import os
import shlex
import subprocess

import pytest

from distill.ablation_table import PAPER_TABLE2, fig3_markdown, main as table_main, table2_markdown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(script, runs, **env):
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", script), "../shared/data", str(runs)], cwd=REPO,
                          env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc, [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_ablation_plan_has_the_papers_rows(tmp_path):
    proc, cmds = _plan("fcsd_ablations.sh", tmp_path, L2_COEFFS="0.1 1")
    assert proc.returncode == 0, proc.stderr
    teacher = [c for c in cmds if "megatron.training.pretrain_gpt" in c]
    assert len(teacher) == 1 and _flag(teacher[0], "--num-layers") == "8"
    assert _flag(teacher[0], "--save") == str(tmp_path / "corpus_moe8_cpu")
    runs = {os.path.basename(_flag(c, "--save")): c for c in cmds if "distill.fcsd" in c}
    assert set(runs) == {f"fcsd_abl_mix_{n}" for n in ("kl_last4", "kl_last6", "kl_last7", "kl_all", "kll2_0.1_all",
                                                       "kll2_1_all", "sft_all", "kl_frozen_all", "kl_bs0.25_all",
                                                       "kl_bs4_all")}  # fmt: skip
    for name, cmd in runs.items():
        assert _flag(cmd, "--load") == str(tmp_path / "corpus_moe8_cpu") and _flag(cmd, "--train-iters") == "300"
        assert "0.5" in cmd and "data/sft/sharegpt_text_document" in cmd  # the mix corpus
    assert [_flag(runs[f"fcsd_abl_mix_kl_last{n}"], "--farskip") for n in (4, 6, 7)] == ["last:4", "last:6", "last:7"]
    assert _flag(runs["fcsd_abl_mix_kll2_0.1_all"], "--kd-loss") == "kl+l2"
    assert _flag(runs["fcsd_abl_mix_kll2_0.1_all"], "--kd-l2-coeff") == "0.1"
    assert "--freeze-embeddings" in runs["fcsd_abl_mix_kl_frozen_all"]
    assert sum("--freeze-embeddings" in c for c in runs.values()) == 1
    assert _flag(runs["fcsd_abl_mix_sft_all"], "--kd-loss") == "sft"
    quarter, four = runs["fcsd_abl_mix_kl_bs0.25_all"], runs["fcsd_abl_mix_kl_bs4_all"]
    assert (_flag(quarter, "--global-batch-size"), _flag(quarter, "--micro-batch-size")) == ("4", "2")
    assert (_flag(four, "--global-batch-size"), _flag(four, "--micro-batch-size")) == ("64", "8")
    reports = [c for c in cmds if "distill.report" in c]
    assert len(reports) == 2
    labels = [s.rpartition("=")[0] for s in reports[0][1:] if s.startswith(("KL", "SFT"))]
    assert "KL (FAR 90%) [last:7 of 8]" in labels and "KL * EMBED. [all, embeddings and output layer frozen]" in labels
    fig3 = [reports[1][i + 1] for i, a in enumerate(reports[1]) if a == "--untrained"]
    assert fig3 == [f"{side}:{n}" for n in range(1, 8) for side in ("first", "last")] + ["all"]
    assert "distill.ablation_table" in cmds[-1] and _flag(cmds[-1], "--num-layers") == "8"


def test_layer_fractions_round_half_up_at_other_depths(tmp_path):
    proc, cmds = _plan("fcsd_ablations.sh", tmp_path, LAYERS="10", L2_COEFFS="1")
    assert proc.returncode == 0, proc.stderr
    lasts = [_flag(c, "--farskip") for c in cmds if "distill.fcsd" in c and "last:" in _flag(c, "--farskip")]
    assert lasts == ["last:5", "last:8", "last:9"]  # 50%, 75% (7.5 -> 8), 90%


def test_finished_runs_and_reports_are_skipped(tmp_path):
    done = tmp_path / "fcsd_abl_mix_sft_all"
    done.mkdir()
    (done / "metrics.jsonl").write_text(json.dumps({"event": "summary", "step": 300}) + "\n")
    (tmp_path / "fcsd_fig3.json").write_text("{}")
    _, cmds = _plan("fcsd_ablations.sh", tmp_path)
    saves = [_flag(c, "--save") for c in cmds if "distill.fcsd" in c]
    assert str(done) not in saves and len(saves) == 9
    reports = [c for c in cmds if "distill.report" in c]
    assert len(reports) == 1 and any(s.startswith("SFT [all]=") for s in reports[0])  # still scored


@pytest.mark.parametrize("env, needle", [
    ({"LAYERS": "1"}, "LAYERS must be at least 2"),
    ({"DATA": "bogus"}, "unknown distillation corpus DATA='bogus'"),
    ({"L2_COEFFS": "0.1 x"}, "L2_COEFFS has 'x'"),
    ({"STEPS": "0"}, "STEPS must be a positive integer"),
    ({"NPROC": "3"}, "does not split over NPROC=3"),
    ({"SEEDS": "1 x"}, "a seed in SEEDS must be a positive integer, got 'x'"),
    ({"JOBS": "0"}, "JOBS must be a positive integer"),
    ({"EP": "-1"}, "EP must be a positive integer"),
    ({"CONNECTIVITY": "sideways"}, "CONNECTIVITY must be reference or paper-text, got 'sideways'"),
])  # fmt: skip
def test_bad_settings_fail_fast(tmp_path, env, needle):
    proc, cmds = _plan("fcsd_ablations.sh", tmp_path / "runs", **env)
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert cmds == [] and not (tmp_path / "runs").exists()


def test_connectivity_sets_the_wiring_of_every_student_and_untrained_conversion(tmp_path):
    """``CONNECTIVITY=paper-text`` reproduces the figures made with that wiring: every student and
    both reports get the flag; without it none does (the default wiring)."""
    _, cmds = _plan("fcsd_ablations.sh", tmp_path, CONNECTIVITY="paper-text", SEEDS="1")
    work = [c for c in cmds if "distill.fcsd" in c or "distill.report" in c]
    assert len(work) == 12 and all(_flag(c, "--farskip-connectivity") == "paper-text" for c in work)
    _, cmds = _plan("fcsd_ablations.sh", tmp_path)
    assert not [c for c in cmds if "--farskip-connectivity" in c]


def test_demo_plans_the_same_commands_after_sharing_its_steps(tmp_path):
    _, cmds = _plan("fcsd_demo.sh", tmp_path, DATASETS="mix")
    assert cmds[0][:4] == ["env", "PYTHON=.venv/bin/python", "TOKENIZERS=bpe", "scripts/prepare_pretrain_corpus.sh"]
    teacher = [c for c in cmds if "megatron.training.pretrain_gpt" in c]
    assert teacher == [[".venv/bin/torchrun", "--standalone", "--nproc_per_node=2", "-m", "megatron.training.pretrain_gpt",
                        "--config", "examples/corpus_moe_cpu.yaml", "--save", str(tmp_path / "corpus_moe_cpu"),
                        "--load", str(tmp_path / "corpus_moe_cpu")]]  # fmt: skip
    runs = [(_flag(c, "--kd-loss"), _flag(c, "--farskip")) for c in cmds if "distill.fcsd" in c]
    assert runs == [("kl", "all"), ("sft", "all"), ("kl", "last:2")]
    assert len([c for c in cmds if "distill.report" in c]) == 1


def _report():
    rows = [
        {"model": "teacher", "farskip": "none", "ppl": 100.0, "ppl_gap_to_teacher": 0.0, "kl_to_teacher": 0.0},
        {"model": "untrained, farskip all", "farskip": "all", "ppl": 210.0, "ppl_gap_to_teacher": 1.1,
         "kl_to_teacher": 0.8},
        {"model": "KL (FAR 90%) [last:7 of 8]", "farskip": "last:7", "ppl": 101.5, "ppl_gap_to_teacher": 0.015,
         "kl_to_teacher": 0.02},
        {"model": "KL + INTER. L2 [all, coefficient 0.1]", "farskip": "all", "ppl": 104.0, "ppl_gap_to_teacher": 0.04,
         "kl_to_teacher": 0.05},
        {"model": "KL + INTER. L2 [all, coefficient 1]", "farskip": "all", "ppl": 106.0, "ppl_gap_to_teacher": 0.06,
         "kl_to_teacher": 0.07},
    ]  # fmt: skip
    return {"rows": rows}


def test_table2_puts_ours_beside_the_papers_rows():
    lines = table2_markdown(_report(), 8).splitlines()
    by_row = {}
    for line in lines[2:]:
        by_row.setdefault(line.split(" | ")[0].lstrip("| "), []).append(line)
    assert set(PAPER_TABLE2) <= set(by_row)
    assert by_row["KL (FAR 90%)"] == [
        "| KL (FAR 90%) | 59.3 | 73.8 | 85.1 | 73.4 | 74.1 | last:7 (87.5%) | 101.50 | +1.5% | 0.020 |"]
    assert by_row["ORIGINAL"][0].endswith("| none (the teacher) | 100.00 | +0.0% | 0.000 |")
    assert len(by_row["KL + INTER. L2"]) == 2 and "all (100.0%); coefficient 0.1 | 104.00" in by_row["KL + INTER. L2"][0]
    assert by_row["KL (FAR 75%)"][0].endswith("| last:6 of 8 (planned) | pending | pending | pending |")
    assert "| untrained, farskip all |" in lines[-1] and "210.00" in lines[-1]


def test_fig3_lists_first_and_last_n_and_pending():
    rows = [{"model": "teacher", "farskip": "none", "ppl": 100.0, "ppl_gap_to_teacher": 0.0, "kl_to_teacher": 0.0},
            {"model": "untrained, farskip first:1", "farskip": "first:1", "ppl": 150.0, "ppl_gap_to_teacher": 0.5,
             "kl_to_teacher": 0.4},
            {"model": "untrained, farskip last:1", "farskip": "last:1", "ppl": 105.0, "ppl_gap_to_teacher": 0.05,
             "kl_to_teacher": 0.03},
            {"model": "untrained, farskip all", "farskip": "all", "ppl": 210.0, "ppl_gap_to_teacher": 1.1,
             "kl_to_teacher": 0.8}]  # fmt: skip
    lines = fig3_markdown({"rows": rows}, 3).splitlines()
    assert lines[2] == "| 1 | 150.00 | 0.400 | 105.00 | 0.030 |"
    assert lines[3] == "| 2 | pending | pending | pending | pending |"
    assert lines[4] == "| 3 (all) | 210.00 | 0.800 | 210.00 | 0.800 |"
    assert lines[5] == "| 0 (the teacher) | 100.00 | 0 | 100.00 | 0 |"


def test_fig3_leaves_out_sub_block_conversions_of_the_same_layers():
    """A report with ``--untrained last:1@mlp-only`` has a second row whose layers are ``last:1``:
    Fig. 3 keeps the whole-layer conversion."""
    rows = [{"model": "untrained, farskip last:1", "farskip": "last:1", "ppl": 105.0, "ppl_gap_to_teacher": 0.05,
             "kl_to_teacher": 0.03},
            {"model": "untrained, farskip last:1@mlp-only", "farskip": "last:1", "farskip_mode": "mlp-only", "ppl": 104.0,
             "ppl_gap_to_teacher": 0.04, "kl_to_teacher": 0.02}]  # fmt: skip
    assert fig3_markdown({"rows": rows}, 3).splitlines()[2] == "| 1 | pending | pending | 105.00 | 0.030 |"


def test_generator_command_writes_markdown_and_marks_missing_reports_pending(tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report()))
    out = tmp_path / "t.md"
    assert table_main(["--table2", str(report), "--fig3", str(tmp_path / "missing.json"), "--num-layers", "8",
                       "--out", str(out)]) == 0  # fmt: skip
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "101.50" in text and "| 7 | pending | pending | pending | pending |" in text


# ---- seeded Table 2 (SEEDS=...): per-seed reports, paired differences from KL (FAR 100%) ----------


def _seed_report(seed, default_ppl, rows, tmp_path=None):
    """One report per seed: the teacher (ppl 80), the default recipe and ``rows`` ({label: ppl})."""
    out = [{"model": "teacher", "farskip": "none", "ppl": 80.0, "ppl_gap_to_teacher": 0.0, "kl_to_teacher": 0.0},
           {"model": f"KL (FAR 100%) [all 8] (seed {seed})", "farskip": "all", "ppl": default_ppl,
            "ppl_gap_to_teacher": default_ppl / 80 - 1, "kl_to_teacher": 0.1}]  # fmt: skip
    for label, ppl in rows.items():
        out.append({"model": f"{label} (seed {seed})", "farskip": "all", "ppl": ppl, "ppl_gap_to_teacher": ppl / 80 - 1,
                    "kl_to_teacher": 0.1 + (ppl - default_ppl) / 1000})  # fmt: skip
    return {"rows": out}


def _seeded_reports():
    # default 100/110/120; SFT +20% every seed; 4x BS -10%, -10%, -9.58%; FAR 50% -5%, -5%, 0%
    per_seed = {1: (100.0, {"SFT [all]": 120.0, "KL 4x BS [all, 64 sequences per step]": 90.0,
                            "KL (FAR 50%) [last:4 of 8]": 95.0}),
                2: (110.0, {"SFT [all]": 132.0, "KL 4x BS [all, 64 sequences per step]": 99.0,
                            "KL (FAR 50%) [last:4 of 8]": 104.5}),
                3: (120.0, {"SFT [all]": 144.0, "KL 4x BS [all, 64 sequences per step]": 108.5,
                            "KL (FAR 50%) [last:4 of 8]": 120.0})}  # fmt: skip
    return [_seed_report(s, d, rows) for s, (d, rows) in per_seed.items()]


def test_paired_interval_is_the_student_t_interval():
    from distill.ablation_table import paired_interval

    r = paired_interval([0.1, 0.3])  # mean 0.2, sd 0.1414, t(0.975, 1) = 12.706: half-width 1.2706
    assert r["n"] == 2 and r["mean"] == pytest.approx(0.2) and r["sd"] == pytest.approx(0.141421, rel=1e-5)
    assert (r["lo"], r["hi"]) == (pytest.approx(-1.07062, abs=1e-4), pytest.approx(1.47062, abs=1e-4))
    r = paired_interval([-0.05, -0.05, 0.0])  # sd 0.028868, t(0.975, 2) = 4.3027: half-width 0.071711
    assert (r["lo"], r["hi"]) == (pytest.approx(-0.105044, abs=1e-5), pytest.approx(0.038377, abs=1e-5))
    assert paired_interval([0.4])["lo"] is None
    with pytest.raises(ValueError):
        paired_interval([])


def test_seeded_table_pairs_by_seed_and_judges_against_the_paper():
    from distill.ablation_table import seeded_table2, seeded_table2_markdown

    table = seeded_table2(_seeded_reports(), 8)
    rows = {e["row"]: e for e in table["rows"]}
    assert list(rows)[:2] == ["ORIGINAL", "KL (FAR 50%)"]  # the paper's order
    assert rows["KL (FAR 100%)"]["ppl_stats"] == {"n": 3, "mean": 110.0, "sd": 10.0}
    assert "vs_default" not in rows["KL (FAR 100%)"]
    sft = rows["SFT"]["vs_default"]
    assert sft["rel_ppl"]["mean"] == pytest.approx(0.2) and sft["rel_ppl"]["lo"] == pytest.approx(0.2)
    assert (sft["noise"], sft["paper"]) == ("worse (outside the noise)", "agrees")  # paper 58.1 < 68.2
    four = rows["KL 4x BS"]["vs_default"]  # -0.0986 [-0.1046, -0.0926]: better, paper 66.6 < 68.2
    assert (four["rel_ppl"]["lo"], four["rel_ppl"]["hi"]) == (pytest.approx(-0.104587, abs=1e-5),
                                                            pytest.approx(-0.092635, abs=1e-5))  # fmt: skip
    assert (four["noise"], four["paper"]) == ("better (outside the noise)", "opposite to the paper")
    half = rows["KL (FAR 50%)"]["vs_default"]
    assert (half["noise"], half["paper"]) == ("within the noise", "no claim")
    assert half["kl"]["mean"] == pytest.approx(-0.0105 / 3)  # KL differences -0.005, -0.0055, 0
    teacher = rows["ORIGINAL"]  # the same in every report, paired under each report's seed
    assert teacher["seeds"] == [1, 2, 3] and teacher["vs_default"]["paper"] == "agrees"
    md = seeded_table2_markdown(table).splitlines()
    line = next(x for x in md if x.startswith("| SFT |"))
    assert "| 58.1 | -10.1 | all (100.0%) | 3 | 132.00 ± 12.00 | +65.0 ± 15.0% |" in line
    assert "| +20.0% [+20.0, +20.0] | worse (outside the noise) | agrees |" in line
    assert "(the reference)" in next(x for x in md if x.startswith("| KL (FAR 100%) |"))


def test_seeded_reports_refuse_mixed_seeds_and_duplicates():
    from distill.ablation_table import rows_by_seed

    mixed = _seeded_reports()[0]
    mixed["rows"].append({**mixed["rows"][2], "model": "SFT [all] (seed 9)"})
    with pytest.raises(ValueError, match="several seeds"):
        rows_by_seed([mixed])
    with pytest.raises(ValueError, match="two rows for 'teacher' at seed 1"):
        rows_by_seed([_seeded_reports()[0], _seeded_reports()[0]])


def test_seeded_command_writes_json_and_convergence_from_run_metrics(tmp_path, capsys):
    reports = _seeded_reports()
    for i, report in enumerate(reports):
        for row in report["rows"][1:]:
            run = tmp_path / f"run_{i}_{row['model'][:6].replace(' ', '_')}"
            run.mkdir(exist_ok=True)
            row["checkpoint"] = str(run / "best")
            events = [{"event": "valid", "step": 10, "heldout_kl": 0.2 + i / 100}, {"step": 15, "loss": 6.0},
                      {"event": "valid", "step": 20, "heldout_kl": 0.1 + i / 100},
                      {"event": "summary", "step": 20, "iteration": 20}]  # fmt: skip
            (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (tmp_path / f"r{i}.json").write_text(json.dumps(report))
    out, js = tmp_path / "t.md", tmp_path / "t.json"
    args = ["--table2", *(str(tmp_path / f"r{i}.json") for i in range(3)), "--num-layers", "8", "--out", str(out),
            "--json", str(js), "--convergence", "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert table_main(args) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.read_text()
    assert text == capsys.readouterr().out
    conv = next(x for x in text.splitlines() if x.startswith("| SFT (all (100.0%)) |"))
    # mean over seeds: step 10 0.21, step 20 0.11; last interval 0.11 / 0.21 - 1 = -47.6%
    assert conv == "| SFT (all (100.0%)) | 3 | 0.2100 | 0.1100 | -47.6% |"
    saved = json.loads(js.read_text())
    assert saved["default_row"] == "KL (FAR 100%)" and len(saved["rows"]) == 5


def test_runs_convergence_of_unscored_and_unfinished_runs(tmp_path, capsys):
    def run(name, kls, finished):
        d = tmp_path / name
        d.mkdir()
        events = [{"event": "valid", "step": 30 * (i + 1), "heldout_kl": kl} for i, kl in enumerate(kls)]
        events += [{"event": "summary", "step": 30 * len(kls), "interrupted": False}] if finished else []
        (d / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        return str(d)

    dirs = [run("fcsd_abl_mix_kl_all_s1", [0.04, 0.02, 0.01], True), run("fcsd_abl_mix_kl_all_s2", [0.06, 0.04], False),
            run("fcsd_abl_mix_sft_all_s1", [0.5, 0.6, 0.45], True)]  # fmt: skip
    assert table_main(["--num-layers", "8", "--runs", *dirs]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| run | seeds | finished | step 30 | step 60 | step 90 | last interval |"
    # kl_all: step 30 (0.04 + 0.06) / 2, step 60 (0.02 + 0.04) / 2, step 90 only seed 1; the last interval
    # (60 -> 90) is taken over the seeds that have both steps: 0.01 / 0.02 - 1 = -50%
    assert lines[4] == "| fcsd_abl_mix_kl_all | 2 | 1 | 0.0500 | 0.0300 | 0.0100 (1) | -50.0% |"
    assert lines[5] == "| fcsd_abl_mix_sft_all | 1 | 1 | 0.5000 | 0.6000 | 0.4500 | -25.0% |"
    assert table_main(["--num-layers", "8", "--runs", str(tmp_path / "nope")]) == 2
    assert "--runs: no such run directory" in capsys.readouterr().err
    assert table_main(["--num-layers", "8", "--runs", *dirs, "--json", str(tmp_path / "t.json")]) == 2
    assert "drop --json" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_several_unseeded_reports_are_refused(tmp_path, capsys):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(_report()))
    assert table_main(["--table2", str(report), str(report), "--num-layers", "8"]) == 2
    assert "one seed per report" in capsys.readouterr().err


def test_seeded_plan_repeats_every_row_and_scores_each_seed(tmp_path):
    proc, cmds = _plan("fcsd_ablations.sh", tmp_path, SEEDS="7 8", NPROC="1", JOBS="2", STEPS="60",
                       TEACHER=str(tmp_path / "teacher"), STUDENT_FLAGS="--eval-interval 15")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = [c for c in cmds if "distill.fcsd" in c]
    assert len(runs) == 20  # 10 rows x 2 seeds, seed-major
    assert [_flag(c, "--seed") for c in runs] == ["7"] * 10 + ["8"] * 10
    assert all(_flag(c, "--save").endswith(f"_s{_flag(c, '--seed')}") for c in runs)
    assert all(_flag(c, "--expert-model-parallel-size") == "1" and _flag(c, "--eval-interval") == "15" for c in runs)
    assert _flag(runs[0], "--global-batch-size") == "64"  # the longest row first
    reports = [c for c in cmds if "distill.report" in c]
    assert [_flag(c, "--out") for c in reports[:2]] == [str(tmp_path / f"fcsd_ablations_report_s{s}.json") for s in (7, 8)]
    for seed, report in zip((7, 8), reports):
        students = [report[i + 1] for i, a in enumerate(report) if a == "--student"]
        assert len(students) == 10 and all(f"(seed {seed})=" in s and s.endswith(f"_s{seed}/best") for s in students)
    table = cmds[-1]
    assert table[table.index("--table2") + 1:table.index("--fig3")] == [_flag(c, "--out") for c in reports[:2]]
    assert "--convergence" in table and _flag(table, "--json") == str(tmp_path / "fcsd_ablations.json")
