"""Host syncs of one engine step through the plain-torch paged attention: none per layer.

A tiny model served by the engine (one rank, the server's code path: ``RankEngine`` over
``build_engine``) runs a prefill step and then decode steps under ``tools.bench.host_syncs.
HostSyncCounter``, which records every call a GPU would wait for (reads of device values on the
host, ops whose output size depends on the data) with the file that made it. Each model is built
with 2 and with 4 layers, and each decode step is run once with the batched path and once with the
per-request loop (``apply_inference`` switches the kernels between steps of the same engine):

- the batched path makes no sync in megatron/compat, and a step's count is the same for 2 and 4
  layers (everything left is per-step bookkeeping of the engine and the sampler);
- the loop path makes one per attention layer (its ``cache_seqlens.tolist()``), so its count grows
  by 2 from 2 to 4 layers: the counter sees the attention's syncs (the first check is not vacuous).

The models: a grouped-query standard MoE (4 query heads over 2 key heads; decode through
``flash_attn_with_kvcache``'s equivalent) and a multi-latent-attention MoE (latent cache; decode
through FlashMLA's equivalent, prefill through the latent cache uncompressed on the device,
megatron/compat/mla.py, which used to read the step's key lengths on the host and take the unique
block ids: two syncs per step). Measured with megatron-core 0.16.1 (both models, 2 or 4 layers):
21 per prefill or decode step with the batched path, all of them the engine's and the sampler's
bookkeeping; 21 + L per decode step with the loop (L attention layers). Only the structure is
asserted, so that a change of the engine's own bookkeeping does not fail this test.
"""

from __future__ import annotations

import os

import pytest

MODELS = {
    "gqa": dict(num_query_groups=2, seq_length=128),
    "mla": dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                v_head_dim=8, seq_length=128),
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12] * 70]  # the last spans two cache blocks at either block size


def step_syncs_rank(rank, world_size, root: str, model: str) -> dict:
    """{num_layers: {"prefill": calls, "decode/batched": calls, "decode/loop": calls}}, each a list of
    (what, file:line) of one engine step."""
    from megatron.compat.inference import apply_inference
    from megatron.compat.paged_attention import PagedAttention
    from megatron.core import parallel_state
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig
    from tests.eval.conftest import save_tiny
    from tools.bench.host_syncs import HostSyncCounter

    result = {}
    for num_layers in (2, 4):
        ckpt = os.path.join(root, f"{model}{num_layers}")
        save_tiny(ckpt, dict(MODELS[model], num_layers=num_layers))
        parallel_state.destroy_model_parallel()
        parallel = ParallelConfig()
        pgc = initialize_parallel(parallel, seed=0)
        loaded, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
        engine = RankEngine(*build_engine(loaded, configs, tokenizer, pgc, EngineConfig(kv_cache_gb=0.01)), loaded)
        for i, prompt in enumerate(PROMPTS):
            engine.add(i, prompt, max_tokens=8, sampling=RequestSampling(), termination_id=-1)
        counts = {}
        for name, path in [("prefill", PagedAttention.BATCHED), ("decode/batched", PagedAttention.BATCHED),
                           ("decode/loop", PagedAttention.LOOP)]:
            apply_inference(path)
            with HostSyncCounter() as syncs:
                engine.step()
            counts[name] = syncs.calls
        apply_inference(PagedAttention.BATCHED)
        result[num_layers] = counts
    return result


@pytest.fixture(scope="module")
def step_syncs(tmp_path_factory):
    from tools.spawn import run_distributed

    root = str(tmp_path_factory.mktemp("syncs"))
    return {model: run_distributed(step_syncs_rank, 1, root, model, timeout_s=300)[0] for model in MODELS}


def _in_compat(calls) -> list:
    compat_dir = os.sep + os.path.join("megatron", "compat") + os.sep
    return [c for c in calls if compat_dir in c[1]]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_batched_steps_sync_the_same_for_2_and_4_layers(step_syncs, model):
    counts = step_syncs[model]
    for step in ("prefill", "decode/batched"):
        assert _in_compat(counts[2][step]) == [] and _in_compat(counts[4][step]) == [], (step, counts[4][step])
        assert len(counts[4][step]) == len(counts[2][step]), (step, counts[2][step], counts[4][step])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_loop_decode_syncs_once_per_layer(step_syncs, model):
    counts = step_syncs[model]
    for layers in (2, 4):
        assert len(_in_compat(counts[layers]["decode/loop"])) == layers, counts[layers]["decode/loop"]
        assert len(counts[layers]["decode/loop"]) == len(counts[layers]["decode/batched"]) + layers
