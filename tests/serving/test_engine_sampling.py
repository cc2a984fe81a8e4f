"""Sampling and log-probs in megatron-core's dynamic engine as the server drives it (engine.py's
``ServingController``, in-process, one rank).

Seeds are tested on the ``flat`` checkpoint (init std 0.02: next-token distributions close to
uniform over 2,048 tokens), where ignoring a seed cannot go unnoticed: two different seeds give
the same 16 sampled tokens with probability far below 1e-20. Log-probs are compared with the
model's plain forward (no KV cache, no paging, the whole prompt at once) with an absolute
tolerance of 1e-4: the paged attention of the engine sums in another order than the static
one (both fp32), which moves log-probs by about 1e-6 here.
"""

from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import PROMPTS

NEW = 16


def _engine(model, configs, tokenizer, pgc, **sizes):
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine

    cfg = EngineConfig(kv_cache_gb=0.01, **sizes)
    return RankEngine(*build_engine(model, configs, tokenizer, pgc, cfg), model)


def _run(engine, jobs: dict) -> dict:
    """Add every job ``{id: (prompt, max_tokens, RequestSampling)}`` at once and step to the end:
    {id: (tokens, logprobs, prompt_logprobs)}."""
    out = {i: ([], [], []) for i in jobs}
    for i, (prompt, max_tokens, spec) in jobs.items():
        engine.add(i, prompt, max_tokens=max_tokens, sampling=spec, termination_id=-1)
    while engine.local_work():
        updates, _ = engine.step()
        for u in updates:
            assert u.failed is None, u.failed
            out[u.request_id][0].extend(u.tokens)
            out[u.request_id][1].extend(u.logprobs or [])
            out[u.request_id][2].extend(u.prompt_logprobs or [])
    return out


def seeds_rank(rank, world_size, ckpt):
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    pgc = initialize_parallel(ParallelConfig(), seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=ParallelConfig(), pg_collection=pgc)
    prompt = tokenizer.tokenize(PROMPTS[0])
    hot = RequestSampling(temperature=1.0)

    def unseeded(server_seed):
        engine = _engine(model, configs, tokenizer, pgc, seed=server_seed)
        return _run(engine, {0: (prompt, NEW, hot)})[0][0]

    def seeded(seed, others: int):
        engine = _engine(model, configs, tokenizer, pgc, seed=99)
        jobs = {0: (prompt, NEW, RequestSampling(temperature=1.0, seed=seed))}
        for k in range(others):  # other requests in the same steps, drawing from the shared generator
            jobs[k + 1] = (tokenizer.tokenize(PROMPTS[k + 1]), NEW + k, hot)
        return _run(engine, jobs)[0][0]

    return {"server": [unseeded(1), unseeded(1), unseeded(2)],
            "request": [seeded(7, 0), seeded(7, 3), seeded(8, 0)]}


def test_seeds_change_and_reproduce_samples(serve_ckpts):
    from tools.spawn import run_distributed

    out = run_distributed(seeds_rank, 1, serve_ckpts["flat"], timeout_s=300)[0]
    first, again, other = out["server"]
    assert len(first) == NEW and first == again  # --seed: the same seed, the same samples
    assert first != other  # a different --seed, different samples (not ignored)
    alone, in_batch, other = out["request"]
    assert alone == in_batch  # a request's own seed: the same tokens whatever shares its steps
    assert alone != other


def logprobs_rank(rank, world_size, ckpt):
    from megatron.inference.sampling import RequestSampling
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import causal_attention_mask
    from moe_variants.config import ParallelConfig

    pgc = initialize_parallel(ParallelConfig(), seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=ParallelConfig(), pg_collection=pgc)
    vocab = tokenizer.vocab_size
    long_prompt = tokenizer.tokenize(" ".join(PROMPTS * 3))[:100]  # chunked: 100 tokens, 64 per step
    prompts = [long_prompt, tokenizer.tokenize(PROMPTS[1]), tokenizer.tokenize(PROMPTS[2])]
    engine = _engine(model, configs, tokenizer, pgc, max_batch_tokens=64, max_requests=4)
    jobs = {0: (prompts[0], 4, RequestSampling(logprobs=3, prompt_logprobs=True)),
            1: (prompts[1], 4, RequestSampling(logprobs=0, prompt_logprobs=True)),
            2: (prompts[2], 4, RequestSampling())}  # asks for nothing: no entries, no extra cost
    got = _run(engine, jobs)
    # the reference: a fresh copy (serving may have switched the model's attention to its latent cache)
    plain, _, _, _ = load_model(ckpt, parallel=ParallelConfig(), pg_collection=pgc)
    reference = []
    for i, prompt in enumerate(prompts):
        tokens = prompt + got[i][0]
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = plain(ids, torch.arange(len(tokens))[None], causal_attention_mask(len(tokens)))
        reference.append(torch.log_softmax(logits[0, :, :vocab].float(), -1))
    return got, [r.tolist() for r in reference]


def test_prompt_and_token_logprobs_equal_the_plain_forward(serve_ckpts):
    from tools.spawn import run_distributed

    got, reference = run_distributed(logprobs_rank, 1, serve_ckpts["standard"], timeout_s=300)[0]
    for i in (0, 1):
        tokens, entries, prompt_entries = got[i]
        logp = torch.tensor(reference[i])  # [S, V]: row s predicts token s + 1
        prompt_len = logp.shape[0] - len(tokens)
        assert len(entries) == len(tokens) == 4
        assert len(prompt_entries) == prompt_len - 1  # every prompt position but the first, once
        full = [e[0] for e in prompt_entries] + [e[0] for e in entries]
        for pos, (token, lp, top) in enumerate(prompt_entries + entries, start=1):
            assert token == full[pos - 1]
            assert lp == pytest.approx(float(logp[pos - 1, token]), abs=1e-4)
            n = 3 if i == 0 else 0
            assert len(top) == n
            if n:
                best = torch.topk(logp[pos - 1], n)
                assert [t for t, _ in top] == best.indices.tolist()
                assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert tokens == [int(logp[prompt_len - 1 + k].argmax()) for k in range(4)]  # greedy
    assert got[2][1] == [] and got[2][2] == []
