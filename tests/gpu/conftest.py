"""The GPU tier's report: each check fills a row (``report`` fixture: ``result`` text, ``figures``,
``notes``); at the end of the session one table is printed and the rows are written as JSON to
``$GPU_CHECK_JSON`` (default ``runs/gpu_check.json``). On a machine without a GPU every check is
skipped before it runs, so nothing is reported."""

from __future__ import annotations

import os
import platform

import pytest

ROWS: list[dict] = []


@pytest.fixture
def report(request):
    row = {"check": request.node.name.removeprefix("test_"), "status": "?", "result": "", "figures": {},
           "notes": []}
    ROWS.append(row)
    request.node._gpu_row = row
    return row


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    row = getattr(item, "_gpu_row", None)
    if row is None or (rep.when != "call" and rep.outcome == "passed"):
        return
    if rep.when == "teardown" and row["status"] != "?":
        return
    row["status"] = rep.outcome
    if rep.skipped and isinstance(rep.longrepr, tuple):
        row["notes"].append(str(rep.longrepr[2]).removeprefix("Skipped: "))
    elif rep.failed:
        lines = [ln for ln in str(rep.longrepr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("E ")]
        row["notes"].append((errors[0] if errors else lines[-1])[:300])


def environment() -> dict:
    import torch

    from megatron import compat

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformer_engine": compat.have_transformer_engine()}
    try:
        env["megatron_core"] = compat.megatron_core_version()
    except ImportError:
        env["megatron_core"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["num_gpus"] = torch.cuda.device_count()
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def table(rows: list[dict]) -> str:
    lines = ["| check | status | result |", "| --- | --- | --- |"]
    for row in rows:
        result = row["result"] or "; ".join(row["notes"])
        lines.append(f"| {row['check']} | {row['status']} | {result.replace('|', '/')} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    from megatron.common.files import write_json

    env = environment()
    path = os.environ.get("GPU_CHECK_JSON", os.path.join("runs", "gpu_check.json"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, {"environment": env, "checks": ROWS}, default=str)
    terminalreporter.write_sep("=", "GPU tier")
    terminalreporter.write_line(", ".join(f"{k} {v}" for k, v in env.items()))
    terminalreporter.write_line(table(ROWS))
    terminalreporter.write_line(f"wrote {path}")
