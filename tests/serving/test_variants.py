"""Every kind of checkpoint through megatron-core's dynamic engine (engine.py, in-process, one
rank) equals its offline reference, token for token (greedy, exact):

- standard and BigMac: evaluate_lm's KV-cached generation (megatron-core's static context);
- FarSkip (all layers): evaluate_lm's recompute generation, so KV-cached FarSkip decoding (the
  WrappedTensor fix in moe_variants/farskip/block.py) equals decoding without a cache;
- a Qwen3-MoE model made with transformers and converted with ``distill.convert``: transformers'
  own ``generate`` (greedy, stopping at EOS).

All prompts go into the engine at once (continuous batching); cancelling a request frees its KV
blocks in the engine's block allocator.
"""

from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import PROMPTS, offline_greedy

MAX_NEW = 20


def engine_greedy_rank(rank, world_size, ckpt: str, prompts, max_new: int, cancel_after: int = -1, sizes=None):
    """Greedy tokens of all prompts submitted together; with ``cancel_after`` >= 0, also the KV
    blocks in use before and after cancelling every request after that many steps. ``sizes``:
    EngineConfig fields (default: a 0.01 GB KV cache)."""
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    parallel = ParallelConfig()
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    engine = RankEngine(*build_engine(model, configs, tokenizer, pgc, EngineConfig(**{"kv_cache_gb": 0.01, **(sizes or {})})),
                        model)
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        tokens = p if isinstance(p, list) else tokenizer.tokenize(p)
        engine.add(i, tokens, max_tokens=max_new, sampling=RequestSampling(), termination_id=tokenizer.eod)
    blocks = []
    while engine.local_work():
        if engine.steps == cancel_after:
            blocks.append(engine.stats()["kv_blocks_used"])
            for i in range(len(prompts)):
                engine.cancel(i)
        for update in engine.step()[0]:
            out[update.request_id] += update.tokens
    blocks.append(engine.stats()["kv_blocks_used"])
    eod = tokenizer.eod
    return [[t for t in out[i] if t != eod] for i in range(len(prompts))], blocks


def _engine(ckpt, prompts, max_new, cancel_after=-1, sizes=None):
    from tools.spawn import run_distributed

    return run_distributed(engine_greedy_rank, 1, ckpt, prompts, max_new, cancel_after, sizes, timeout_s=240)[0]


@pytest.mark.parametrize("variant,mode", [("standard", "kv_cache"), ("bigmac", "kv_cache"), ("farskip", "recompute")])
def test_engine_equals_offline_generation(serve_ckpts, variant, mode):
    reference, used = offline_greedy(serve_ckpts[variant], PROMPTS, MAX_NEW, generation=mode)
    assert used == mode
    tokens, _ = _engine(serve_ckpts[variant], PROMPTS, MAX_NEW)
    assert tokens == [t for t, _ in reference]


def test_cancel_releases_kv_blocks(serve_ckpts):
    _, blocks = _engine(serve_ckpts["standard"], PROMPTS, 60, cancel_after=5)
    assert blocks[0] >= len(PROMPTS) and blocks[-1] == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_converted_hf_model_equals_transformers_generate(tmp_path, family):
    """Qwen3-MoE (grouped-query attention) and DeepSeek-V2 (multi-latent attention: served from
    megatron-core's latent cache with absorbed decoding, megatron/compat/mla.py)."""
    _converted_engine_run(tmp_path, family)


def _converted_engine_run(tmp_path, family):
    """Convert a tiny random HF model, check the engine's greedy tokens against transformers'
    ``generate``; (checkpoint, prompts, expected tokens)."""
    pytest.importorskip("transformers")
    from tools.spawn import run_distributed
    from tests.convert import hf_models as H

    hf_dir = H.make_hf_model(str(tmp_path / "hf"), family)
    ckpt = str(tmp_path / "ckpt")
    codes = run_distributed(H.cli_rank, 1, [["--from", "hf", "--hf-dir", hf_dir, "--to", "mcore", "--out", ckpt]],
                            timeout_s=240)[0]
    assert codes[0][0] == 0, codes
    model = H.load_hf_model(hf_dir, family)
    prompts = H.PROMPT.tolist()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=H.NEW_TOKENS, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
            expected.append([t for t in out if t != 2][:H.NEW_TOKENS] if 2 not in out else out[:out.index(2)])
    tokens, _ = _engine(ckpt, prompts, H.NEW_TOKENS)
    assert tokens == expected
    return ckpt, prompts, expected


@pytest.mark.slow  # a server started as a process
def test_converted_deepseek_v2_served_at_ep2_equals_transformers_generate(tmp_path):
    """The converted DeepSeek-V2 through the HTTP server on two ranks (EP=2, MLA's latent cache)."""
    from tests.serving.conftest import Server, post

    ckpt, prompts, expected = _converted_engine_run(tmp_path, "deepseek_v2")
    srv = Server(ckpt, tmp_path, nproc=2, extra=["--expert-model-parallel-size", "2"])
    try:
        got = []
        for prompt in prompts:
            status, body = post(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                             "return_token_ids": True})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
    finally:
        srv.stop()
    assert got == expected


@pytest.mark.slow  # a server started as a process
def test_server_variant_flag_applies_connectivity_only_presets(serve_ckpts, tmp_path):
    """``serve --variant farskip`` on the standard checkpoint serves the FarSkip model: its greedy
    tokens are those of the FarSkip checkpoint (the tiny checkpoints are built from the same seed
    and FarSkip changes no parameter, so they hold the same weights) and not the standard model's.
    A preset that changes parameters (bigmac) is refused by the checkpoint's architecture check:
    one line naming the field, exit 2."""
    import os
    import subprocess
    import sys

    from tests.serving.conftest import REPO, Server, post

    farskip, _ = offline_greedy(serve_ckpts["farskip"], PROMPTS[:3], MAX_NEW, generation="recompute")
    standard, _ = offline_greedy(serve_ckpts["standard"], PROMPTS[:3], MAX_NEW)
    assert [t for t, _ in farskip] != [t for t, _ in standard]  # the two connectivities differ here
    srv = Server(serve_ckpts["standard"], tmp_path, extra=["--variant", "farskip"])
    try:
        got = []
        for prompt in PROMPTS[:3]:
            status, body = post(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                                             "return_token_ids": True})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
    finally:
        assert srv.stop() == 0
    assert got == [t for t, _ in farskip]
    proc = subprocess.run([sys.executable, "-m", "megatron.inference.serve", "--load", serve_ckpts["standard"],
                           "--variant", "bigmac", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "holds a different model: moe_variant" in err[0], proc.stderr
