"""How the server picks tokens and scores them: pure functions over logits, no engine state.

``RequestSampling`` is what one request asked for. ``sample`` draws the next token of a group of
requests that share their parameters: greedy (temperature below 1e-5, as vLLM) is the argmax; otherwise the logits
are divided by the temperature, cut to the ``top_k`` largest, then to the smallest set whose
probability reaches ``top_p`` (both filters apply when both are given, in that order, as vLLM
and Hugging Face do), and one token is drawn with the given ``torch.Generator``. ``token_logprobs``
gives the log-probability of chosen tokens and the ``top_n`` most likely alternatives, from the
model's distribution *before* temperature, top-k and top-p (what vLLM returns by default and what
lm-eval's loglikelihood scoring needs), over the tokenizer's vocabulary only (the output layer's
padding columns are never tokens).

Shape legend: ``B`` requests (or rows), ``V`` tokenizer vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["RequestSampling", "LogprobEntry", "filter_logits", "sample", "token_logprobs", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's default cap)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-124 overflow

# (token id, its log-probability, ((alternative id, log-probability), ... best first))
LogprobEntry = tuple


@dataclasses.dataclass
class RequestSampling:
    """One request's sampling and scoring options (``temperature == 0``: greedy)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: Optional[int] = None  # its own generator: tokens independent of the batch it shares
    logprobs: Optional[int] = None  # None: no log-probs; N >= 0: the chosen token's and N alternatives
    prompt_logprobs: bool = False  # also score the prompt's tokens (completions' ``echo``)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def bucket(self) -> tuple:
        """Requests with equal buckets are sampled together (unseeded ones only)."""
        return (self.temperature, self.top_k, self.top_p)


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """A copy of ``logits_BV`` with every token outside the top-k, then outside the top-p
    nucleus, set to -inf. The nucleus keeps the most likely tokens until their probability
    reaches ``top_p``; the most likely token is always kept."""
    out = logits_BV.clone()
    num_v = out.shape[-1]
    if 0 < top_k < num_v:
        kth_B1 = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out.masked_fill_(out < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(out, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV.float(), dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV  # probability of the better tokens
        drop_BV = mass_before_BV >= top_p
        drop_BV[..., 0] = False
        out.scatter_(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    return out


def sample(logits_BV: torch.Tensor, spec: RequestSampling, generator: torch.Generator) -> torch.Tensor:
    """Next tokens [B] of rows that share ``spec``'s temperature, top-k and top-p."""
    if spec.greedy:
        return torch.argmax(logits_BV, dim=-1)
    scaled_BV = logits_BV.float() / spec.temperature
    probs_BV = torch.softmax(filter_logits(scaled_BV, spec.top_k, spec.top_p), dim=-1)
    return torch.multinomial(probs_BV, num_samples=1, generator=generator).view(-1)


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, top_n: int) -> list:
    """A ``LogprobEntry`` per row: the log-probability of ``tokens_B[b]`` under row b's
    distribution (fp32 log-softmax) and its ``top_n`` most likely tokens."""
    logp_BV = torch.log_softmax(logits_BV.float(), dim=-1)
    chosen = logp_BV.gather(-1, tokens_B.view(-1, 1).long()).view(-1).tolist()
    tokens = tokens_B.view(-1).tolist()
    if top_n > 0:
        values, ids = torch.topk(logp_BV, min(top_n, logp_BV.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [(int(t), float(lp), top) for t, lp, top in zip(tokens, chosen, tops)]
