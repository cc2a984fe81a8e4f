"""The server's sampling and scoring functions (megatron/inference/sampling.py) against hand
computations: the top-k and top-p cuts (both applied, top-k first), seeded draws, and
log-probabilities with their top alternatives. Exact comparisons except the empirical
frequencies (20,000 draws: a 4-sigma band of the binomial standard error)."""

import math

import pytest
import torch

from megatron.inference.sampling import RequestSampling, filter_logits, sample, token_logprobs


def _logits(probs):
    return torch.tensor([probs]).log()


def test_top_k_then_top_p_keep_the_documented_tokens():
    logits = _logits([0.5, 0.3, 0.15, 0.05])
    kept = lambda k, p: torch.isfinite(filter_logits(logits, k, p))[0].tolist()  # noqa: E731
    assert kept(2, 1.0) == [True, True, False, False]
    # nucleus: keep tokens until their mass reaches top_p (0.5 < 0.6, then 0.8 >= 0.6)
    assert kept(0, 0.6) == [True, True, False, False]
    assert kept(0, 0.5) == [True, False, False, False]
    assert kept(0, 0.81) == [True, True, True, False]
    assert kept(0, 0.01) == [True, False, False, False]  # the best token always stays
    # both: top-k first (renormalised: 0.625, 0.375), then top-p over what is left
    assert kept(3, 0.9) == [True, True, True, False]
    assert kept(2, 0.62) == [True, False, False, False]  # 0.625 >= 0.62 already
    assert kept(0, 0.62) == [True, True, False, False]  # without the top-k cut 0.5 < 0.62


def test_sampling_frequencies_follow_the_cut_distribution():
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = sample(logits.expand(n, 4), RequestSampling(temperature=1.0, top_k=3, top_p=0.8), gen)
    # top-3 renormalised: 4/9, 3/9, 2/9; top-p 0.8: 4/9 + 3/9 = 0.78 < 0.8 keeps the third too
    expected = [4 / 9, 3 / 9, 2 / 9, 0.0]
    freq = torch.bincount(draws, minlength=4).double() / n
    for f, p in zip(freq.tolist(), expected):
        assert abs(f - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-12
    assert freq[3] == 0


def test_temperature_and_seeds():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    greedy = sample(logits, RequestSampling(), torch.Generator())
    assert greedy.tolist() == [int(logits.argmax())]
    # a temperature so small that logits / temperature overflow is greedy (found by the fuzz test)
    assert sample(logits * 1e3, RequestSampling(temperature=8e-124), torch.Generator()).tolist() == greedy.tolist()
    spec = RequestSampling(temperature=1.5)

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [int(sample(logits, spec, gen)) for _ in range(30)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_token_logprobs_and_top_alternatives():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    entries = token_logprobs(logits, torch.tensor([1, 3]), top_n=2)
    logp = torch.log_softmax(logits, -1)
    assert entries[0][0] == 1 and entries[0][1] == pytest.approx(float(logp[0, 1]), abs=0)
    assert [i for i, _ in entries[0][2]] == [0, 1]
    assert entries[0][2][1][1] == entries[0][1]  # the same number when the token is among the top
    assert entries[1][1] == pytest.approx(-math.log(4), rel=1e-6)
    assert token_logprobs(logits, torch.tensor([0, 0]), top_n=0)[0][2] == ()
