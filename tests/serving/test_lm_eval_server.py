"""lm-eval scores a served model through the OpenAI API exactly as it scores the checkpoint in
process: ``lm_eval --model local-completions`` with the server's remote tokenizer, against a
two-rank EP server, equals ``python -m megatron.training.evaluate_lm`` on one process, for a
loglikelihood task (ARC-style multiple choice) and a loglikelihood_rolling task (WikiText-style
perplexity), on generated files in the shared-data layout, hub unreachable.

lm-eval's API models keep one token of the context for generation and one more for the rolling
windows' context, so ``max_length=32`` (the checkpoint's seq_length) through the server reads the
same windows as ``evaluate_lm --max-length 30``: the 32-token context makes the articles span
several windows. Accuracies must be equal; log-likelihood sums and perplexities within rtol 1e-4
(the server scores with megatron-core's paged attention and chunked batches, evaluate_lm with the
plain forward, both fp32: they differ by about 1e-6 per token).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from tests.eval.conftest import make_checkpoints  # noqa: E402
from tests.eval.test_evaluate_lm import OFFLINE, TASKS_DIR, _generated_data  # noqa: E402
from tests.serving.conftest import REPO, Server  # noqa: E402

pytestmark = pytest.mark.slow

TASKS = "local_arc_easy,local_wikitext"


def _run(cmd, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, OPENAI_API_KEY="unused", **OFFLINE)
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_local_completions_through_the_server_equals_evaluate_lm(tmp_path):
    ckpt = make_checkpoints(tmp_path / "ckpts")["standard"]
    data = _generated_data(tmp_path / "data")
    srv = Server(ckpt, tmp_path, nproc=2, extra=["--expert-model-parallel-size", "2",
                                                  "--enable-tokenizer-info-endpoint"])
    try:
        assert srv.info["context_length"] == 32
        _run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
              f"base_url={srv.url}/v1/completions,tokenizer_backend=remote,max_length=32,max_retries=1",
              "--tasks", TASKS, "--include_path", TASKS_DIR, "--metadata", json.dumps({"data_dir": str(data)}),
              "--limit", 4, "--output_path", tmp_path / "served"])
    finally:
        srv.stop()
    [served_file] = glob.glob(str(tmp_path / "served" / "**" / "results_*.json"), recursive=True)
    with open(served_file) as f:
        served = json.load(f)["results"]
    _run([sys.executable, "-m", "megatron.training.evaluate_lm", "--load", ckpt, "--tasks", TASKS,
          "--include-path", TASKS_DIR, "--data-dir", data, "--limit", 4, "--bootstrap-iters", 0,
          "--max-length", 30, "--output", tmp_path / "offline.json"])
    with open(tmp_path / "offline.json") as f:
        offline = json.load(f)["results"]
    for metric in ("acc,none", "acc_norm,none"):
        assert served["local_arc_easy"][metric] == offline["local_arc_easy"][metric]
    assert served["local_wikitext"]["sample_len"] == offline["local_wikitext"]["sample_len"] == 3
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert served["local_wikitext"][metric] == pytest.approx(offline["local_wikitext"][metric], rel=1e-4)
        assert 1 < offline["local_wikitext"][metric] < float("inf") or metric == "bits_per_byte,none"
