"""Served greedy tokens are the same with the batched paged attention and the per-request loop,
and equal the offline reference (exact, token for token).

Two tiny models (``tests.eval.conftest.save_tiny``, init std 0.5 so next-token distributions are
peaked): a grouped-query standard MoE (4 query heads over 2 key heads, 32-token KV blocks) and a
multi-latent-attention MoE (latent cache in 64-token blocks: prefill through the uncompressed
latents, decode through FlashMLA's equivalent). All prompts enter the engine at once with a 64-token
step budget, so the long prompt is prefilled in chunks while the others decode (mixed steps,
chunks after cached keys, ragged key lengths, padded rows). Each engine runs once per path
(``EngineConfig.paged_attention``); the reference is evaluate_lm's generation: KV-cached for the
standard model, recomputing the whole sequence for MLA (which megatron-core's static context does
not serve from a latent cache).
"""

from __future__ import annotations

import os

import pytest

from tests.serving.conftest import PROMPTS, offline_greedy

MAX_NEW = 12
MODELS = {
    "gqa": (dict(num_query_groups=2), "kv_cache"),
    "mla": (dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                 v_head_dim=8), "recompute"),
}


def _save_rank(rank, world_size, root: str) -> dict:
    from megatron.core import parallel_state

    from tests.eval.conftest import save_tiny

    paths = {}
    for name, (overrides, _) in MODELS.items():
        paths[name] = os.path.join(root, name)
        save_tiny(paths[name], dict(overrides, seq_length=128))
        parallel_state.destroy_model_parallel()
    return paths


def _prompts(ckpt: str) -> list:
    from megatron.components.loading import checkpoint_configs, load_tokenizer

    configs, manifest, path = checkpoint_configs(ckpt)
    tok = load_tokenizer(manifest, path)
    long = tok.tokenize(" ".join(PROMPTS * 4))[:100]
    return [tok.tokenize(p) for p in PROMPTS[:4]] + [long]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    from tools.spawn import run_distributed

    return run_distributed(_save_rank, 1, str(tmp_path_factory.mktemp("paths")), timeout_s=300)[0]


def _paths_rank(rank, world_size, ckpt: str, prompts) -> dict:
    """{path: (greedy tokens of every prompt, KV blocks in use at the end)}: one engine per path
    over the same loaded model, all prompts submitted at once."""
    from megatron.compat.paged_attention import PagedAttention
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    parallel = ParallelConfig()
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    result = {}
    for path in PagedAttention:
        cfg = EngineConfig(max_batch_tokens=64, max_requests=8, kv_cache_gb=0.01, paged_attention=path)
        engine = RankEngine(*build_engine(model, configs, tokenizer, pgc, cfg), model)
        out = {i: [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add(i, prompt, max_tokens=MAX_NEW, sampling=RequestSampling(), termination_id=tokenizer.eod)
        while engine.local_work():
            for update in engine.step()[0]:
                out[update.request_id] += update.tokens
        result[path.value] = ([[t for t in out[i] if t != tokenizer.eod] for i in range(len(prompts))],
                              engine.stats()["kv_blocks_used"])
    return result


@pytest.mark.parametrize("model", sorted(MODELS))
def test_batched_and_loop_paths_serve_the_offline_tokens(ckpts, model):
    from tools.spawn import run_distributed

    prompts = _prompts(ckpts[model])
    reference, mode = offline_greedy(ckpts[model], prompts, MAX_NEW, generation=MODELS[model][1])
    assert mode == MODELS[model][1]
    expected = [t for t, _ in reference]
    served = run_distributed(_paths_rank, 1, ckpts[model], prompts, timeout_s=300)[0]
    assert set(served) == {"batched", "loop"}
    for path, (tokens, blocks) in served.items():
        assert tokens == expected, path
        assert blocks == 0, path
