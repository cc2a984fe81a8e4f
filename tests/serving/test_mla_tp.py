"""Multi-latent attention and tensor parallelism in the server: the layouts the papers serve in.

- The DeepSeek-V2-Lite-shaped checkpoint (``mla_ckpt``: MLA with YaRN and latent norms, a dense
  first layer, shared and fine-grained routed experts, trained a few steps by pretrain_gpt) through
  megatron-core's dynamic engine (latent KV cache, absorbed decoding through the FlashMLA
  equivalent, megatron/compat/mla.py) gives evaluate_lm's greedy tokens (its recompute
  generation: the plain forward without a cache), with prompts of one token (a prefill step of
  one-token queries) and of 100 tokens chunked over two steps.
- Its prefill-chunk and decode log-probs equal the plain forward's within 1e-4 (fp32, another
  summation order: the paged attention and the absorbed product).
- Served over HTTP at EP=2, TP=2 and TP=2 x EP=2 (4 processes), the standard and the MLA model give
  the same greedy tokens as the same model at TP=1/EP=1 without a cache (exact); BigMac and FarSkip
  (all layers) at TP=2 x EP=2 too.
- Layouts that cannot work are refused in one line before the server starts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest
import torch

from tests.serving.conftest import PROMPTS, REPO, Server, offline_greedy, post

pytestmark = pytest.mark.slow  # the MLA checkpoint is trained with torchrun; servers are processes

MAX_NEW = 12


def _prompts(tokenizer_ckpt):
    from megatron.components.loading import checkpoint_configs, load_tokenizer

    configs, manifest, path = checkpoint_configs(tokenizer_ckpt)
    tok = load_tokenizer(manifest, path)
    long = tok.tokenize(" ".join(PROMPTS * 4))[:100]
    return [tok.tokenize(p) for p in PROMPTS[:3]] + [[tok.tokenize("Hello")[0]], long]


def test_mla_engine_equals_the_forward_without_cache(mla_ckpt):
    from tests.serving.test_variants import _engine

    prompts = _prompts(mla_ckpt)
    reference, mode = offline_greedy(mla_ckpt, prompts, MAX_NEW, generation="recompute")
    assert mode == "recompute"
    tokens, blocks = _engine(mla_ckpt, prompts, MAX_NEW, sizes={"max_batch_tokens": 64, "max_requests": 8})
    assert tokens == [t for t, _ in reference]
    assert blocks == [0]  # every latent block released


def test_mla_prefill_chunks_and_decode_logprobs_equal_the_forward(mla_ckpt):
    from tools.spawn import run_distributed
    from tests.serving.test_engine_sampling import logprobs_rank

    got, reference = run_distributed(logprobs_rank, 1, mla_ckpt, timeout_s=300)[0]
    for i in (0, 1):
        tokens, entries, prompt_entries = got[i]
        logp = torch.tensor(reference[i])
        assert len(prompt_entries) == logp.shape[0] - len(tokens) - 1 and len(entries) == len(tokens) == 4
        for pos, (token, lp, _) in enumerate(prompt_entries + entries, start=1):
            assert lp == pytest.approx(float(logp[pos - 1, token]), abs=1e-4)


LAYOUTS = {
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2ep2": (4, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
}


# every layout with MLA; each other model at one layout, each layout at least twice (the variants'
# other layouts on MLA: test_farskip_preset_on_the_mla_model, test_bigmac_with_mla_...)
CASES = [("mla", layout) for layout in sorted(LAYOUTS)] + [
    ("standard", "ep2"), ("standard", "tp2ep2"), ("bigmac", "tp2"), ("farskip", "tp2ep2")]

# the references, each computed once in this file (a process each): {(kind, ckpt, prompts, preset): tokens}
_REFERENCES: dict = {}


def offline_reference(ckpt, prompts) -> list:
    """evaluate_lm's greedy tokens by its recompute generation (the plain forward, no cache)."""
    key = ("offline", ckpt, repr(prompts), None)
    if key not in _REFERENCES:
        reference, mode = offline_greedy(ckpt, prompts, MAX_NEW, generation="recompute")
        assert mode == "recompute"
        _REFERENCES[key] = [t for t, _ in reference]
    return _REFERENCES[key]


def forward_reference(ckpt, prompts, preset=None) -> list:
    """``recompute_greedy_rank``'s tokens of the checkpoint with ``preset``'s connectivity overrides."""
    from tools.spawn import run_distributed
    from moe_variants import registry

    key = ("forward", ckpt, repr(prompts), preset)
    if key not in _REFERENCES:
        overrides = registry.preset_overrides(preset) if preset else {}
        _REFERENCES[key] = run_distributed(recompute_greedy_rank, 1, ckpt, prompts, MAX_NEW, overrides,
                                           timeout_s=300)[0]
    return _REFERENCES[key]


@pytest.mark.parametrize("model,layout", CASES)
def test_served_layouts_equal_tp1_ep1(model, layout, serve_ckpts, mla_ckpt, tmp_path):
    ckpt = mla_ckpt if model == "mla" else serve_ckpts[model]
    prompts = _prompts(ckpt)[:4]
    reference = offline_reference(ckpt, prompts)
    nproc, extra = LAYOUTS[layout]
    srv = Server(ckpt, tmp_path, nproc=nproc, extra=extra)
    try:
        got = served_greedy(srv.url, prompts, MAX_NEW)
    finally:
        srv.stop()
    assert got == reference


def served_greedy(url: str, prompts: list, max_new: int) -> list:
    """The server's greedy completion token ids of each prompt (one request each, all must be 200)."""
    got = []
    for ids in prompts:
        status, body = post(url, "/v1/completions", {"prompt": ids, "max_tokens": max_new, "temperature": 0,
                                                     "return_token_ids": True})
        assert status == 200, body
        got.append(body["choices"][0]["token_ids"])
    return got


@pytest.mark.parametrize("flags,needle", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
    (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3"),
    (["--block-size-tokens", "32"], "blocks of 64 tokens"),
    (["--expert-comm", "allreduce", "--expert-model-parallel-size", "2"], "--expert-comm allreduce needs"),
])
def test_bad_layouts_are_one_line(flags, needle, mla_ckpt):
    proc = subprocess.run([sys.executable, "-m", "megatron.inference.serve", "--load", mla_ckpt, "--port", "0", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


def test_bench_serve_runs_an_mla_checkpoint_at_tp2(mla_ckpt, tmp_path):
    """bench_serve's --tensor-model-parallel-size: the servers' layout in its JSON, every request's
    tokens served (loopback, no root needed)."""
    import json

    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "scripts/bench_serve.py", "--load", mla_ckpt, "--no-netns", "--ranks", "2",
                           "--tensor-model-parallel-size", "2", "--input-len", "16", "--output-len", "6",
                           "--request-rates", "inf", "--num-requests", "4", "--warmup-requests", "0", "--no-plots", "--runs", "1",
                           "--json", str(out), "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["config"]["tensor_model_parallel_size"] == 2 and data["config"]["expert_model_parallel_size"] == 1
    rate = data["variants"]["standard"]["rates"]["inf"]
    assert rate["num_requests"] == 4 and rate["output_tokens"] == 4 * 6 and rate["failed_requests"] == 0


def recompute_greedy_rank(rank, world_size, ckpt, prompts, max_new, overrides):
    """Greedy tokens by the plain forward over the whole sequence at every step (no cache), of the
    checkpoint loaded with ``overrides`` (a connectivity-only preset)."""
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import causal_attention_mask
    from moe_variants.config import ParallelConfig

    pgc = initialize_parallel(ParallelConfig(), seed=0)
    model, _, tokenizer, _ = load_model(ckpt, parallel=ParallelConfig(), overrides=overrides, pg_collection=pgc)
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new):
            with torch.no_grad():
                logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], causal_attention_mask(len(ids)))
            ids.append(int(logits[0, -1, :tokenizer.vocab_size].argmax()))
        out.append(ids[len(prompt):])
    return out


def _served_tokens(ckpt, tmp_path, prompts, extra, nproc):
    srv = Server(ckpt, tmp_path, nproc=nproc, extra=extra)
    try:
        got = []
        for ids in prompts:
            status, body = post(srv.url, "/v1/completions", {"prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
                                                             "return_token_ids": True, "ignore_eos": True})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        return got
    finally:
        srv.stop()


@pytest.mark.parametrize("layout,preset", [("one", "farskip"), ("tp2ep2", "farskip-async-tp")])
def test_farskip_preset_on_the_mla_model(layout, preset, mla_ckpt, tmp_path):
    """FarSkip's connectivity on the DeepSeek-V2-shaped model (``--variant farskip``: its
    overlapped inference schedule around MLA's latent-cache attention; ``farskip-async-tp``: with
    the attention's TP reduction in flight behind the MoE, paper §4.2) equals that model's forward
    without a cache (the async reduction changes when the sum is taken, not what it is; the
    synchronous schedule at TP 2 x EP 2 on the GQA model: test_served_layouts_equal_tp1_ep1[farskip-tp2ep2])."""
    prompts = _prompts(mla_ckpt)[:3]
    reference = forward_reference(mla_ckpt, prompts, "farskip")
    nproc, extra = LAYOUTS[layout] if layout != "one" else (1, [])
    assert _served_tokens(mla_ckpt, tmp_path, prompts, [*extra, "--variant", preset], nproc) == reference


@pytest.mark.parametrize("model,layout,preset", [("standard", "ep2", "farskip-split"), ("mla", "one", "farskip-split"),
                                                 ("mla", "ep2", "farskip-split"), ("standard", "ep2", "farskip-heads"),
                                                 ("mla", "ep2", "farskip-heads")])
def test_farskip_split_attention_serves_the_forward_tokens(model, layout, preset, serve_ckpts, mla_ckpt, tmp_path):
    """``--variant farskip-split``: at inference attention is split at its input projections (run
    behind the previous combine) and the rest, over the KV cache (behind the dispatch);
    ``farskip-heads``: a prefill's core attention is split by heads over the two windows. Self-
    attention and MLA (latent cache, absorbed decoding) give the forward's tokens without a cache."""
    ckpt = mla_ckpt if model == "mla" else serve_ckpts[model]
    prompts = _prompts(ckpt)[:3]
    reference = forward_reference(ckpt, prompts, "farskip")
    nproc, extra = LAYOUTS[layout] if layout != "one" else (1, [])
    assert _served_tokens(ckpt, tmp_path, prompts, [*extra, "--variant", preset], nproc) == reference


@pytest.mark.parametrize("preset", [None, "farskip-split-async-tp"])  # the async-TP path with and without the split
def test_replicated_experts_serve_the_forward_tokens(preset, mla_ckpt, tmp_path):
    """``--expert-comm allreduce`` (vLLM's layout, paper §4.2) at TP = EP = 2 on 2 processes: every
    rank holds every token and one all-reduce sums the local experts; with ``farskip-async-tp`` it
    and the attention's and shared expert's TP reductions are all in flight behind compute. The
    tokens equal the model's forward without a cache (standard, or FarSkip connectivity)."""
    prompts = _prompts(mla_ckpt)[:3]
    reference = forward_reference(mla_ckpt, prompts, "farskip" if preset else None)
    extra = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-comm", "allreduce"]
    if preset:
        extra += ["--variant", preset]
    assert _served_tokens(mla_ckpt, tmp_path, prompts, extra, 2) == reference


MLA_TINY = dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                v_head_dim=8, qk_layernorm=True, seq_length=128, moe_layer_freq=[0, 1], ffn_hidden_size=64,
                moe_variant="bigmac", bigmac_ratio=0.5)


def _save_bigmac_mla(path):
    import os
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.eval.conftest import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        save_tiny(path, MLA_TINY)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bigmac_mla_ckpt(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bigmac_mla") / "ckpt")
    code = f"import sys; sys.path.insert(0, {REPO!r}); from tests.serving.test_mla_tp import _save_bigmac_mla; " \
           f"_save_bigmac_mla({ckpt!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


@pytest.mark.parametrize("layout", ["engine", "tp2ep2"])
def test_bigmac_with_mla_equals_the_forward_without_cache(layout, bigmac_mla_ckpt, tmp_path):
    """BigMac's low-dimension all-to-all on an MLA model (a checkpoint of its own: BigMac changes
    parameters), through the engine's latent cache in process and served, equals the forward
    without a cache."""
    from tests.serving.test_variants import _engine

    prompts = _prompts(bigmac_mla_ckpt)[:3]
    expected = offline_reference(bigmac_mla_ckpt, prompts)
    if layout == "engine":
        assert _engine(bigmac_mla_ckpt, prompts, MAX_NEW)[0] == expected
        return
    nproc, extra = LAYOUTS[layout]
    got = _served_tokens(bigmac_mla_ckpt, tmp_path, prompts, extra, nproc)
    assert [g[:len(e)] for g, e in zip(got, expected)] == expected  # offline stops at EOD; served ignores it


def test_tp_with_routing_stats_is_refused_in_one_line(serve_ckpts, tmp_path):
    from tests.helpers import torchrun

    proc = torchrun("megatron.inference.serve", ["--load", serve_ckpts["standard"], "--port", "0",
                                                 "--tensor-model-parallel-size", "2", "--routing-stats"])
    assert proc.returncode != 0
    # torchrun's closing summary quotes the line too ("traceback : megatron.inference.serve: error: ...")
    # rank 0 says it in one line; rank 1, when it says it before torchrun stops it (a loaded machine),
    # in a line of its own naming itself
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megatron.inference.serve: error:")]
    first = [line for line in lines if not line.startswith("megatron.inference.serve: error: rank 1: ")]
    assert len(first) == 1 and all("--routing-stats" in line for line in lines), proc.stderr[-2000:]


def _place_mla(rank, world, ckpt, root):
    """Profile the MLA checkpoint on generated prompts, solve Sem-MoE tables for 2 devices, apply."""
    from moe_variants.semmoe.methods import place
    from moe_variants.semmoe.tables import save_tables
    from tests.semmoe.conftest import write_prompts
    from tools.semmoe.apply import apply_placement
    from tools.semmoe.model_run import RunOptions, profile_rank

    write_prompts(Path(root) / "prompts.jsonl", 48, seed=3)
    profile = profile_rank(RunOptions(load=ckpt, data=f"{root}/prompts.jsonl", batch_tokens=256))
    save_tables(place("semmoe", profile, 2, seed=0), f"{root}/tables2")
    apply_placement(ckpt, f"{root}/tables2", f"{root}/placed2")


def test_semmoe_placed_mla_model_with_algorithm_2_equals_the_unplaced_model(mla_ckpt, tmp_path):
    """Sem-MoE's placement (experts permuted over the two EP ranks) and request scheduling
    (Algorithm 2) on the DeepSeek-V2-shaped model: the served tokens equal the unplaced model's
    forward without a cache."""
    from tools.spawn import run_distributed

    run_distributed(_place_mla, 1, mla_ckpt, str(tmp_path), timeout_s=600)
    prompts = _prompts(mla_ckpt)[:3]
    reference = forward_reference(mla_ckpt, prompts)
    got = _served_tokens(str(tmp_path / "placed2"), tmp_path, prompts,
                         ["--expert-model-parallel-size", "2", "--semmoe-tables", str(tmp_path / "tables2")], 2)
    assert got == reference
