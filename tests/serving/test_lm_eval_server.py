"""lm-eval scores a served model through the OpenAI API as it scores the checkpoint in process, item
by item, on the shipped offline tasks: ``lm_eval --model local-completions`` with the server's remote
tokenizer and ``max_length=512``, against a two-rank EP server, equals ``python -m
megatron.training.evaluate_lm --max-length 510`` on one process, for ``local_arc_easy`` and
``local_wikitext`` at ``--limit 10`` from the shared data directory, hub unreachable (the commands of
docs/guides/serve.md).

The checkpoint is pretrain_gpt's small MoE with a 512-token context, 40 steps on the embedded corpus
(tiny-shakespeare speeches, each followed by EOD): the WikiText articles span many windows, and the
model already predicts EOD after many sentences and answers. That is the case the served path got
wrong: lm-eval sends ``echo`` with ``max_tokens: 1`` and sums ``token_logprobs[ctxlen:-1]``, and the
server dropped the log-prob entry of a generated EOD, so the prompt's last log-prob was lost (at
``--limit 50``, 15 of the 50 ARC items scored ~4 nats higher than in process, acc_norm 0.18 against 0.22).

lm-eval's API models keep one token for the generated token and one for the rolling windows'
context, so ``max_length=512`` reads the windows of ``--max-length 510``.

Tolerance: every per-request log-likelihood within ``EPS_TOKEN`` nats per scored token (counted
with the checkpoint's tokenizer). Both sides sum the same fp32 per-token log-probs in fp64; the
per-token values can differ in their last bits where the engine's paged, chunked steps and the
plain padded forward multiply matrices of other shapes (up to 2.4e-6 nats measured on a 128-token
demo checkpoint; bit-identical on this one), so 1e-5 leaves a 4x margin. Accuracies must be equal
except on items whose two best choices are within their bounds (a near tie); perplexities within the
bound the per-document one implies for their word and byte counts.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from tests.data.conftest import SHARED_DATA, requires_shared_data  # noqa: E402
from tests.eval.test_evaluate_lm import OFFLINE, TASKS_DIR  # noqa: E402
from tests.helpers import torchrun  # noqa: E402
from tests.serving.conftest import REPO, Server, post  # noqa: E402

pytestmark = [pytest.mark.slow, requires_shared_data]

TASKS = "local_arc_easy,local_wikitext"
LIMIT = 10  # documents per task: 40 ARC requests and 10 WikiText articles' windows
SEQ_LENGTH = 512
EPS_TOKEN = 1e-5  # nats per scored token (see the module docstring)
PRETRAIN = [
    "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--ffn-hidden-size", 128,
    "--seq-length", SEQ_LENGTH, "--max-position-embeddings", SEQ_LENGTH, "--num-experts", 4, "--moe-router-topk", 2,
    "--moe-ffn-hidden-size", 64, "--moe-shared-expert-intermediate-size", 64, "--transformer-impl", "local",
    "--micro-batch-size", 4, "--global-batch-size", 4, "--lr", 3e-3, "--lr-warmup-iters", 2, "--train-iters", 40,
    "--log-interval", 10, "--eval-interval", 1000, "--eval-iters", 0, "--split", "949,50,1", "--save-interval", 40,
]


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, OPENAI_API_KEY="unused", **OFFLINE)
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _lls(sample) -> list[float]:
    """A sample's log-likelihoods: one per choice, or the document's rolling one (lm-eval's samples
    file holds them as strings, Python's repr of the float)."""
    return [float(r[0] if isinstance(r, list) else r) for r in sample["filtered_resps"]]


def _by_doc(samples) -> dict:
    return {int(s["doc_id"]): s for s in samples}


def _served(ckpt, tmp_path, data) -> tuple[dict, dict, list]:
    """lm-eval through a two-rank EP server: (results, {task: {doc_id: sample}}, the greedy
    finish reasons after the first ARC prompts)."""
    srv = Server(ckpt, tmp_path, nproc=2, extra=["--expert-model-parallel-size", "2",
                                                  "--enable-tokenizer-info-endpoint"])
    try:
        assert srv.info["context_length"] == SEQ_LENGTH
        _run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
              f"base_url={srv.url}/v1/completions,tokenizer_backend=remote,max_length={SEQ_LENGTH},max_retries=1",
              "--tasks", TASKS, "--include_path", TASKS_DIR, "--metadata", json.dumps({"data_dir": str(data)}),
              "--limit", LIMIT, "--log_samples", "--output_path", tmp_path / "served"])
        samples = {}
        for task in TASKS.split(","):
            [path] = glob.glob(str(tmp_path / "served" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
            with open(path) as f:
                samples[task] = _by_doc(json.loads(line) for line in f)
        [path] = glob.glob(str(tmp_path / "served" / "**" / "results_*.json"), recursive=True)
        with open(path) as f:
            results = json.load(f)["results"]
        prompts = [ctx + cont for s in list(samples["local_arc_easy"].values())[:16]
                   for ctx, cont in _arguments(s)]
        status, body = post(srv.url, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0})
        assert status == 200, body
    finally:
        srv.stop()
    return results, samples, [c["finish_reason"] for c in body["choices"]]


def _arguments(sample) -> list:
    """A sample's request arguments as lists: lm-eval's samples file stores them as
    ``{"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}``, evaluate_lm's output as lists."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [[a[k] for k in sorted(a)] for _, a in sorted(args.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return args


def test_local_completions_through_the_server_equals_evaluate_lm_item_by_item(tmp_path):
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    ckpt = tmp_path / "ckpt"
    proc = torchrun("megatron.training.pretrain_gpt", PRETRAIN + ["--save", ckpt, "--data-cache-path",
                                                                  tmp_path / "cache"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served, served_samples, finishes = _served(ckpt, tmp_path, SHARED_DATA)
    # the checkpoint predicts EOD right after some of the scored answers (the case that lost a log-prob)
    assert "stop" in finishes
    _run([sys.executable, "-m", "megatron.training.evaluate_lm", "--load", ckpt, "--tasks", TASKS,
          "--include-path", TASKS_DIR, "--data-dir", SHARED_DATA, "--limit", LIMIT, "--bootstrap-iters", 0,
          "--max-length", SEQ_LENGTH - 2, "--log-samples", "--output", tmp_path / "offline.json"])
    with open(tmp_path / "offline.json") as f:
        payload = json.load(f)
    offline, offline_samples = payload["results"], {t: _by_doc(s) for t, s in payload["samples"].items()}
    tokenizer = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)

    # ARC-Easy: every choice's log-likelihood, then the accuracies (near ties may differ)
    arc_off, arc_srv = offline_samples["local_arc_easy"], served_samples["local_arc_easy"]
    assert sorted(arc_off) == sorted(arc_srv) == list(range(LIMIT))
    differing = {"acc": set(), "acc_norm": set()}
    for doc_id, off in arc_off.items():
        srv = arc_srv[doc_id]
        lo, ls = _lls(off), _lls(srv)
        bounds = [EPS_TOKEN * (len(tokenizer.tokenize(ctx + cont)) - len(tokenizer.tokenize(ctx)))
                  for ctx, cont in _arguments(off)]
        assert all(abs(a - b) <= e for a, b, e in zip(lo, ls, bounds)), f"doc {doc_id}: in process {lo}, served {ls}"
        for metric, norm in (("acc", [1.0] * len(lo)), ("acc_norm", [float(len(c)) for c in off["doc"]["choices"]])):
            if off[metric] != srv[metric]:
                best = sorted(range(len(lo)), key=lambda i: -lo[i] / norm[i])[:2]
                gap = lo[best[0]] / norm[best[0]] - lo[best[1]] / norm[best[1]]
                assert gap <= sum(bounds[i] / norm[i] for i in best), (doc_id, metric, lo, ls)
                differing[metric].add(doc_id)
    for metric, docs in differing.items():
        assert abs(served["local_arc_easy"][f"{metric},none"] - offline["local_arc_easy"][f"{metric},none"]) \
            <= len(docs) / LIMIT + 1e-12

    # WikiText: every article's rolling log-likelihood, then the perplexities
    wiki_off, wiki_srv = offline_samples["local_wikitext"], served_samples["local_wikitext"]
    assert sorted(wiki_off) == sorted(wiki_srv) and len(wiki_off) == offline["local_wikitext"]["sample_len"] == LIMIT
    total_bound = 0.0
    for doc_id, off in wiki_off.items():
        [[text]] = _arguments(off)
        bound = EPS_TOKEN * len(tokenizer.tokenize(text))
        assert abs(_lls(off)[0] - _lls(wiki_srv[doc_id])[0]) <= bound, doc_id
        total_bound += bound
    words = sum(s["word_perplexity"][1] for s in wiki_off.values())
    num_bytes = sum(s["byte_perplexity"][1] for s in wiki_off.values())
    srv_wiki, off_wiki = served["local_wikitext"], offline["local_wikitext"]
    assert 1 < off_wiki["word_perplexity,none"] < float("inf")
    assert srv_wiki["word_perplexity,none"] == pytest.approx(off_wiki["word_perplexity,none"],
                                                            rel=math.expm1(total_bound / words))
    assert srv_wiki["byte_perplexity,none"] == pytest.approx(off_wiki["byte_perplexity,none"],
                                                            rel=math.expm1(total_bound / num_bytes))
    assert srv_wiki["bits_per_byte,none"] == pytest.approx(off_wiki["bits_per_byte,none"],
                                                          abs=total_bound / (num_bytes * math.log(2)))
