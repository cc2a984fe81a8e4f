"""scripts/fcsd_wirings.sh (FCSD's rows under both FarSkip wirings on one teacher) and its tables
(distill/wiring_table.py).

The script is checked through ``DRY_RUN=1`` (its commands in order, nothing trained): the rows and
wirings, one rank per process without torchrun, the watchdogs off, resume and the one-line
refusals. The tables are checked on synthetic reports and run logs, with figures chosen so that
every verdict can be worked out by hand.
"""

import json
import os
import shlex
import subprocess

import pytest

from distill.wiring_table import build, converged, main as table_main, markdown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "fcsd_wirings.sh")


def _plan(runs, **env):
    proc = subprocess.run(["bash", SCRIPT, "../shared/data", str(runs)], cwd=REPO, env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc, [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def _module(cmd):
    return cmd[cmd.index("-m") + 1] if "-m" in cmd else None


def test_plan_runs_the_differing_rows_under_both_wirings(tmp_path):
    proc, cmds = _plan(tmp_path, SEEDS="1234 1235")
    assert proc.returncode == 0, proc.stderr
    teacher = [c for c in cmds if _module(c) == "megatron.training.pretrain_gpt"]
    assert [_flag(c, "--train-iters") for c in teacher] == ["1000", "2000"]
    assert _flag(teacher[1], "--load") == _flag(teacher[0], "--save") == str(tmp_path / "corpus_dsv2lite_routing")
    assert _flag(teacher[1], "--lr-decay-iters") == "1000"
    assert all(_flag(c, "--expert-model-parallel-size") == "1" for c in teacher)
    work = [c for c in cmds if _module(c) in ("megatron.training.pretrain_gpt", "distill.fcsd")]
    for c in work:  # one rank without torchrun, so that stopping the script's process group pauses it
        assert "torchrun" not in " ".join(c) and "WORLD_SIZE=1" in c and "MASTER_PORT=0" in c
        assert all(_flag(c, f"--{w}-timeout") == "0" for w in ("heartbeat", "step", "startup", "save", "eval"))
    students = [c for c in cmds if _module(c) == "distill.fcsd"]
    names = [os.path.basename(_flag(c, "--save")) for c in students]
    rows = ["kl_all", "kl_last4", "kl_last4_paper-text", "kl_last6", "kl_last6_paper-text"]
    assert names == [f"fcsd_abl_mix_{r}_s{s}" for s in (1234, 1235) for r in rows]
    by_name = dict(zip(names, students))
    for s in (1234, 1235):
        for n in (4, 6):
            ref, pt = by_name[f"fcsd_abl_mix_kl_last{n}_s{s}"], by_name[f"fcsd_abl_mix_kl_last{n}_paper-text_s{s}"]
            assert _flag(ref, "--farskip") == _flag(pt, "--farskip") == f"last:{n}"
            assert (_flag(ref, "--farskip-connectivity"), _flag(pt, "--farskip-connectivity")) == ("reference", "paper-text")
        assert "--farskip-connectivity" not in by_name[f"fcsd_abl_mix_kl_all_s{s}"]  # the same under both
    for c in students:
        assert (_flag(c, "--train-iters"), _flag(c, "--eval-interval"), _flag(c, "--expert-model-parallel-size")) == ("60", "15", "1")
        assert _flag(c, "--load") == str(tmp_path / "corpus_dsv2lite_routing_2000") and "data/sft/sharegpt_text_document" in c
    reports = [c for c in cmds if _module(c) == "distill.report"]
    untrained = {_flag(c, "--farskip-connectivity"): [c[i + 1] for i, a in enumerate(c) if a == "--untrained"] for c in reports[:2]}
    assert untrained["reference"] == ([f"{side}:{n}" for n in range(1, 8) for side in ("first", "last")]
                                      + ["all", "last:1@attn-only", "last:1@mlp-only", "all@attn-only", "all@mlp-only"])
    assert untrained["paper-text"] == [f"last:{n}" for n in range(1, 8)] + ["all", "last:1@attn-only", "last:1@mlp-only"]
    seeded = reports[2:]
    assert [os.path.basename(_flag(c, "--out")) for c in seeded] == ["wirings_report_s1234.json", "wirings_report_s1235.json"]
    labels = [a.rpartition("=")[0] for a in seeded[0] if a.startswith("KL")]
    assert labels == ["KL (FAR 100%) [all 8] (seed 1234)", "KL (FAR 50%) [last:4 of 8, reference] (seed 1234)",
                      "KL (FAR 50%) [last:4 of 8, paper-text] (seed 1234)", "KL (FAR 75%) [last:6 of 8, reference] (seed 1234)",
                      "KL (FAR 75%) [last:6 of 8, paper-text] (seed 1234)"]  # fmt: skip
    assert cmds.index(seeded[0]) < cmds.index(by_name["fcsd_abl_mix_kl_all_s1235"])  # seed by seed


def test_finished_runs_and_reports_are_skipped(tmp_path):
    for name in ("corpus_dsv2lite_routing", "corpus_dsv2lite_routing_2000", "fcsd_abl_mix_kl_last4_paper-text_s7"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"event": "summary", "step": 1}) + "\n")
    (tmp_path / "untrained_paper-text.json").write_text("{}")
    proc, cmds = _plan(tmp_path, SEEDS="7")
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in cmds if _module(c) == "megatron.training.pretrain_gpt"]
    saves = [os.path.basename(_flag(c, "--save")) for c in cmds if _module(c) == "distill.fcsd"]
    assert len(saves) == 4 and "fcsd_abl_mix_kl_last4_paper-text_s7" not in saves
    reports = [os.path.basename(_flag(c, "--out")) for c in cmds if _module(c) == "distill.report"]
    assert reports == ["untrained_reference.json", "wirings_report_s7.json"]


@pytest.mark.parametrize("env, needle", [
    ({"WIRINGS": "reference sideways"}, "WIRINGS has 'sideways'"),
    ({"WIRINGS": "paper-text"}, "WIRINGS must include reference"),
    ({"SEEDS": "1 x"}, "a seed in SEEDS must be a positive integer, got 'x'"),
    ({"SEEDS": " "}, "SEEDS is empty"),
    ({"CONTINUE_ITERS": "1000"}, "CONTINUE_ITERS (1000) must exceed TEACHER_ITERS (1000)"),
    ({"JOBS": "0"}, "JOBS must be a positive integer"),
])  # fmt: skip
def test_bad_settings_fail_fast(tmp_path, env, needle):
    proc, cmds = _plan(tmp_path / "runs", **env)
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert cmds == [] and not (tmp_path / "runs").exists()


def test_converged_is_less_than_delta_on_the_best_over_the_last_evaluations():
    def log(*values, early_stop=None):
        return {"curve": {15 * (i + 1): v for i, v in enumerate(values)}, "early_stop": early_stop}

    falling = converged(log(0.10, 0.08, 0.07, 0.06), 0.02, 2)
    assert falling["converged"] is False and falling["last_change"] == pytest.approx(0.06 / 0.08 - 1)
    flat = converged(log(0.10, 0.08, 0.0795, 0.0790), 0.02, 2)
    assert flat["converged"] is True and flat["last_change"] == pytest.approx(0.079 / 0.08 - 1)  # -1.25% > -2%
    assert converged(log(0.10, 0.08, 0.09, 0.085), 0.02, 2)["converged"] is True  # no new best at all
    assert converged(log(0.10, 0.08), 0.02, 2)["converged"] is None  # too few evaluations to tell
    assert converged(log(0.10, 0.08, early_stop=30), 0.02, 2)["converged"] is True
    assert converged(None, 0.02, 2)["converged"] is None


def _row(model, ppl, kl, farskip=None, wiring=None, checkpoint=None, teacher_ppl=100.0, mode=None):
    row = {"model": model, "farskip": farskip, "ppl": ppl, "kl_to_teacher": kl, "ppl_gap_to_teacher": ppl / teacher_ppl - 1}
    if wiring:
        row["farskip_connectivity"] = wiring
    if checkpoint:
        row["checkpoint"] = checkpoint
    if mode:
        row["farskip_mode"] = mode
    return row


# per seed: KL all, last:4 reference, last:4 paper-text (held-out ppl)
PPL = {1: (110.0, 105.0, 106.0), 2: (112.0, 106.0, 108.0), 3: (111.0, 104.0, 103.0)}
FLAT, FALLING = (0.05, 0.040, 0.0399, 0.0398), (0.05, 0.040, 0.030, 0.020)


def _write_runs(tmp_path, curves):
    """Reports and run logs in the committed layout: the reports and <run>/metrics.jsonl side by side."""
    paths = []
    for seed, (kl_all, ref, pt) in PPL.items():
        rows = [_row("teacher", 100.0, 0.0, "none"), _row("untrained, farskip all", 130.0, 0.3, "all", "reference")]
        for name, label, ppl, spec, wiring in (
                ("kl_all", "KL (FAR 100%) [all 8]", kl_all, "all", "reference"),
                ("kl_last4", "KL (FAR 50%) [last:4 of 8, reference]", ref, "last:4", "reference"),
                ("kl_last4_paper-text", "KL (FAR 50%) [last:4 of 8, paper-text]", pt, "last:4", "paper-text")):  # fmt: skip
            run = f"fcsd_abl_mix_{name}_s{seed}"
            rows.append(_row(f"{label} (seed {seed})", ppl, ppl / 1000, spec, wiring, f"runs/elsewhere/{run}/best"))
            (tmp_path / run).mkdir()
            events = [{"event": "valid", "step": 15 * (i + 1), "heldout_kl": v} for i, v in enumerate(curves[name])]
            events.append({"event": "summary", "step": 60, "early_stop": None})
            (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        path = tmp_path / f"wirings_report_s{seed}.json"
        path.write_text(json.dumps({"teacher": "runs/t", "text": "test.txt", "windows": 300, "rows": rows}))
        paths.append(str(path))
    untrained = []
    for wiring, last in (("reference", {1: 120.0, 4: 125.0}), ("paper-text", {1: 121.0, 4: 126.0})):
        rows = [_row("teacher", 100.0, 0.0, "none")]
        if wiring == "reference":
            rows += [_row(f"untrained, farskip first:{n}", 101.0 + n, 0.01 * n, f"first:{n}", wiring) for n in range(1, 8)]
        rows += [_row(f"untrained, farskip last:{n}", last.get(n, 122.0), 0.2, f"last:{n}", wiring) for n in range(1, 8)]
        rows += [_row("untrained, farskip all", 130.0, 0.3, "all", wiring),
                 _row("untrained, farskip last:1@attn-only", 100.0 if wiring == "paper-text" else 100.5, 0.001, "last:1",
                      wiring, mode="attn-only"),
                 _row("untrained, farskip last:1@mlp-only", 119.0, 0.19, "last:1", wiring, mode="mlp-only")]  # fmt: skip
        path = tmp_path / f"untrained_{wiring}.json"
        path.write_text(json.dumps({"teacher": "runs/t", "rows": rows}))
        untrained.append(str(path))
    return paths, untrained


def test_tables_pair_seeds_compare_wirings_and_word_unconverged_verdicts(tmp_path):
    seeds, untrained = _write_runs(tmp_path, {"kl_all": FALLING, "kl_last4": FLAT, "kl_last4_paper-text": FLAT})
    table = build(seeds, untrained, 8)
    rows = {(e["row"], e["wiring"]): e for e in table["rows"]}
    kl_all, ref, pt = rows[("KL (FAR 100%)", "reference")], rows[("KL (FAR 50%)", "reference")], rows[("KL (FAR 50%)", "paper-text")]
    assert kl_all["converged"] is False and ref["converged"] is True and pt["converged"] is True
    assert ref["vs_default"]["rel_ppl"] == pytest.approx([105 / 110 - 1, 106 / 112 - 1, 104 / 111 - 1])
    # better than KL all in every seed, as the paper's FAR 50% row; KL all still falling: direction only
    assert ref["vs_default"]["verdict"] == "better in 3/3 seeds, as the paper (direction only)"
    (w,) = table["wirings"]
    assert w["rel_ppl"] == pytest.approx([105 / 106 - 1, 106 / 108 - 1, 104 / 103 - 1])
    assert w["verdict"] == "mixed (reference lower in 2/3 seeds)"  # both converged: no qualifier
    assert w["kl_diff"]["min"] == pytest.approx(-0.002) and w["kl_diff"]["max"] == pytest.approx(0.001)
    assert [f["last"]["paper-text"]["ppl"] for f in table["fig3"][:1]] == [121.0]
    assert table["fig3"][0]["last"]["reference"]["ppl"] == 120.0 and table["fig3"][0]["first"]["ppl"] == 102.0
    assert table["fig3"][7]["first"]["ppl"] == 130.0 and table["fig3"][7]["last"]["paper-text"]["ppl"] == 130.0
    subs = {s["wiring"]: s for s in table["sub_blocks"]}
    assert subs["paper-text"]["attn-only"]["gap"] == 0.0 and subs["reference"]["both"]["ppl"] == 120.0
    text = markdown(table)
    assert "| KL (FAR 50%) | last:4 (50.0%) | paper-text | 3 |" in text
    assert "| 0/3; best KL -50.0% to -50.0% over the last 2 evaluations |" in text  # KL all: best 0.04 -> 0.02
    assert "| last:1 | paper-text | +0.0% (KL 0.001) | +19.0% (KL 0.190) | +21.0% (KL 0.200) |" in text


def test_command_writes_json_and_markdown_and_refuses_bad_input(tmp_path, capsys):
    seeds, untrained = _write_runs(tmp_path, {"kl_all": FLAT, "kl_last4": FLAT, "kl_last4_paper-text": FLAT})
    out, md = tmp_path / "table.json", tmp_path / "table.md"
    assert table_main(["--seeds", *seeds, "--untrained", *untrained, "--num-layers", "8", "--json", str(out), "--out", str(md)]) == 0
    table = json.loads(out.read_text())
    ref = next(e for e in table["rows"] if e["row"] == "KL (FAR 50%)" and e["wiring"] == "reference")
    assert ref["vs_default"]["verdict"] == "better in 3/3 seeds, as the paper"  # every student converged
    assert ref["curves"]["1"]["30"] == 0.04 and md.read_text() == capsys.readouterr().out
    for argv, says in ((["--num-layers", "8"], "give --seeds"), (["--seeds", str(tmp_path / "no.json"), "--num-layers", "8"], "no such report"),
                       (["--seeds", *seeds, "--num-layers", "8", "--converged-delta", "2"], "--converged-delta must be in (0, 1)")):  # fmt: skip
        assert table_main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and err.strip().count("\n") == 0
