"""netsim.validation and ``netsim predict`` / ``validate`` on a synthetic bench_serve run: what is
predicted, how it is compared with what the run measured, and the one-line refusals."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from netsim.replay import MODEL_VERSION
from netsim.validation import code_version, phase_figures, predict_run, validate_run
from tests.netsim.conftest import link_table, link_table_paths
from tests.netsim.test_replay import C, PROF


def _profile(**kw):
    return dict(PROF.__dict__, lar=0.5, **kw)


def _run(lar=0.5):
    reqs = [{"sent": 0.5 * i, "prompt_tokens": 20, "output_tokens": 5, "max_tokens": 5, "ok": True}
            for i in range(6)]
    rates = {"2": {"ttft_s": {"p50": 0.05}, "tpot_s": {"p50": 0.02}, "output_tokens_per_s": 10.0}}
    return {"schema": "bench_serve/1", "mode": "serve",
            "network": {"shaped": True, "link": {"gbit": 0.5}},
            "config": {"ranks": 2, "variants": ["standard"], "server": {"max_batch_tokens": 64, "max_requests": 4}},
            "variants": {"standard": {"lar": lar, "rates": rates}}, "requests": {"standard": {"rate-2": reqs}}}


def test_phase_figures():
    f = phase_figures([0.1, 0.3], [1.1, 2.3], [11, 21], [0.0, 1.0])
    assert f["ttft_p50_s"] == pytest.approx(0.2)
    assert f["tpot_p50_s"] == pytest.approx((0.1 + 0.1) / 2)
    assert f["output_tokens_per_s"] == pytest.approx(32 / 3.3)


def test_predict_scales_bytes_by_the_measured_lar_and_validate_compares(tmp_path):
    t = link_table(tmp_path)
    base = predict_run(_run(0.5), {"standard": _profile()}, C, t)["standard"]["2"]
    local = predict_run(_run(1.0), {"standard": _profile()}, C, t)["standard"]["2"]  # everything local: no bytes
    assert local["ttft_p50_s"] < base["ttft_p50_s"]
    res = validate_run(_run(), {"standard": {"2": base}})
    assert res["points"] == 3 and res["model_version"] == MODEL_VERSION
    ttft = next(r for r in res["rows"] if r["figure"] == "ttft_p50_s")
    assert ttft["relative_error"] == pytest.approx((base["ttft_p50_s"] - 0.05) / 0.05)
    assert res["mean_abs_rel_error"] == pytest.approx(sum(abs(r["relative_error"]) for r in res["rows"]) / 3)
    with pytest.raises(ValueError, match="no variant"):
        predict_run(_run(), {"bigmac": _profile()}, C, t)
    with pytest.raises(ValueError, match="2 ranks at 0.25 Gbit/s; the run served 2 ranks at 0.5"):
        predict_run(_run(), {"standard": _profile()}, C, link_table(tmp_path, gbit=0.25))


def test_predict_names_what_an_old_profile_lacks(tmp_path):
    """A profile from before the measured layouts (or the loop's measured overhead) is refused in
    one line that names the variant and the missing input."""
    t = link_table(tmp_path)
    for key in ("layout_decode", "iteration_s"):
        prof = _profile()
        del prof[key]
        with pytest.raises(ValueError, match=f"the profile of 'standard': no {key} "):
            predict_run(_run(), {"standard": prof}, C, t)


def test_validate_cli(tmp_path, capsys):
    from netsim.cli import main

    run = tmp_path / "serve.json"
    run.write_text(json.dumps(_run()))
    (tmp_path / "serve.profile.json").write_text(json.dumps(
        {"schema": "serving-compute-profile/1", "variants": {"standard": _profile()}}))
    tables = link_table_paths(tmp_path)
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables, "--json", str(tmp_path / "v.json")]) == 0
    out = json.loads((tmp_path / "v.json").read_text())
    assert out["points"] == 3 and out["mean_abs_rel_error"] >= 0 and out["link_table"] == tables
    assert out["model_version"] == MODEL_VERSION and out["code_version"] == code_version()
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == f"replay model {MODEL_VERSION}, code at git {code_version()}"
    assert "mean absolute relative error over 3 points" in printed
    # an earlier version reproduces what was reported with it, and names itself
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables, "--model-version", "replay/7",
                 "--json", str(tmp_path / "v7.json")]) == 0
    v7 = json.loads((tmp_path / "v7.json").read_text())
    assert v7["model_version"].startswith("replay/7 ") and v7["predicted"] != out["predicted"]
    capsys.readouterr()
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables, "--model-version", "replay/0"]) == 2
    err = capsys.readouterr().err
    assert "--model-version: no replay model 'replay/0'" in err and len(err.strip().splitlines()) == 1
    assert main(["validate", "--bench-serve", str(tmp_path / "missing.json"), "--link-table", *tables]) == 2
    assert "--bench-serve" in capsys.readouterr().err
    assert main(["validate", "--bench-serve", str(run)]) == 2  # the link table is a required input
    assert "--link-table" in capsys.readouterr().err
    link_table_paths(tmp_path, gbit=0.25)  # rewritten at another rate than the run's 0.5 Gbit/s
    assert main(["validate", "--bench-serve", str(run), "--link-table", *tables]) == 2
    err = capsys.readouterr().err
    assert "link table" in err and len(err.strip().splitlines()) == 1


def test_validate_reads_a_gzipped_run_and_refuses_a_summary(tmp_path, capsys):
    """docs/figures keeps the runs it replays gzipped: ``serve.json.gz`` is read as it is, with its
    profile ``serve.profile.json`` beside it; a figure summary without the requests is one line."""
    import gzip

    from netsim.cli import main

    with gzip.open(tmp_path / "serve.json.gz", "wt") as f:
        json.dump(_run(), f)
    (tmp_path / "serve.profile.json").write_text(json.dumps(
        {"schema": "serving-compute-profile/1", "variants": {"standard": _profile()}}))
    tables = link_table_paths(tmp_path)
    assert main(["predict", "--bench-serve", str(tmp_path / "serve.json.gz"), "--link-table", *tables]) == 0
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(_run()))
    (tmp_path / "plain.profile.json").write_text((tmp_path / "serve.profile.json").read_text())
    assert main(["predict", "--bench-serve", str(plain), "--link-table", *tables]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[1] and out[1] == out[out.index(out[0], 1) + 1]  # the same prediction from both
    summary = {k: v for k, v in _run().items() if k != "requests"}
    plain.write_text(json.dumps(summary))
    assert main(["predict", "--bench-serve", str(plain), "--link-table", *tables]) == 2
    err = capsys.readouterr().err
    assert "without the run's requests" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "broken.json.gz").write_bytes(b"not gzip")
    assert main(["predict", "--bench-serve", str(tmp_path / "broken.json.gz"), "--link-table", *tables]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_code_version_is_the_git_commit_of_the_replay():
    got = code_version()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=__file__.rsplit("/", 1)[0]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        assert got.startswith("unknown")
        return
    assert re.fullmatch(head + "(-dirty)?", got)


def test_code_version_outside_a_git_checkout(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert code_version() == "unknown (not a git checkout)"


def test_validate_counts_throughput_only_above_saturation():
    """Throughput is counted only where the server fell behind the offered load (requests/s
    below 0.8 x offered); TTFT and TPOT always count; per-figure means are of their own points."""
    run = _run()
    run["variants"]["standard"]["rates"] = {
        "2": {"ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.02}, "output_tokens_per_s": 10.0,
              "offered_rate": 2.0, "requests_per_s": 1.7},  # kept up: offered-load bound
        "8": {"ttft_s": {"p50": 0.4}, "tpot_s": {"p50": 0.04}, "output_tokens_per_s": 20.0,
              "offered_rate": 8.0, "requests_per_s": 4.0},  # saturated
    }
    pred = {"standard": {"2": {"ttft_p50_s": 0.11, "tpot_p50_s": 0.018, "output_tokens_per_s": 5.0},
                         "8": {"ttft_p50_s": 0.3, "tpot_p50_s": 0.05, "output_tokens_per_s": 22.0}}}
    res = validate_run(run, pred)
    by = res["by_figure"]
    assert by["ttft_p50_s"]["points"] == 2 and by["ttft_p50_s"]["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25) / 2)
    assert by["tpot_p50_s"]["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25) / 2)
    assert by["output_tokens_per_s"]["points"] == 1 and by["output_tokens_per_s"]["max_abs_rel_error"] == pytest.approx(0.1)
    assert res["points"] == 5 and res["mean_abs_rel_error"] == pytest.approx((0.1 + 0.25 + 0.1 + 0.25 + 0.1) / 5)
    assert res["all_points"] == 6 and res["mean_abs_rel_error_all_points"] == pytest.approx(1.3 / 6)
    assert res["unmodelled"] == {}
    run["variants"]["standard"]["request_scheduler"] = "semmoe-algorithm-2"
    assert "round-robin" in validate_run(run, pred)["unmodelled"]["standard"]


def test_predict_refuses_tensor_parallel_layouts_it_does_not_model(tmp_path):
    """TP is modelled where TP = EP = the ranks (one engine) with the link's all-reduce
    calibrations; the replicated-experts layout, a profile taken at another TP and a table without
    all-reduces are refused in one line."""
    t = link_table(tmp_path)
    run = _run()
    run["config"]["tensor_model_parallel_size"] = 2
    tp_layout = (0.0,) * 7  # reduce, dispatch, combine, dispatch, combine, gather, after
    prof = {"standard": _profile(tp=2, tp_allreduces=1, tp_allreduce_bytes_per_token=10.0, tp_gathers=1,
                                 layout_decode=tp_layout, layout_prefill=tp_layout)}
    run["config"]["expert_model_parallel_size"] = 1
    with pytest.raises(ValueError, match="TP 2 x EP 1"):
        predict_run(run, prof, C, t)
    run["config"]["expert_model_parallel_size"] = 2
    with pytest.raises(ValueError, match="taken at TP 1"):
        predict_run(run, {"standard": _profile()}, C, t)
    with pytest.raises(ValueError, match="all_reduce calibrations"):
        predict_run(run, prof, C, t)
    run["config"]["expert_comm"] = "allreduce"
    with pytest.raises(ValueError, match="allreduce"):
        predict_run(run, prof, C, t)


def test_recorded_assignment_is_replayed_and_its_absence_noted(tmp_path):
    t = link_table(tmp_path)
    run = _run()
    run["variants"]["standard"]["request_scheduler"] = "semmoe-algorithm-2"
    pred = predict_run(run, {"standard": _profile()}, C, t)
    assert "standard" in validate_run(run, pred)["unmodelled"]
    for r in run["requests"]["standard"]["rate-2"]:
        r["dp_rank"] = 1
    assert validate_run(run, predict_run(run, {"standard": _profile()}, C, t))["unmodelled"] == {}
