"""The serving benchmark's requests, as pure functions of the prompts, the tokenizer and a seed.

Every variant of a run gets the same requests (token ids and ``max_tokens``) at the same arrival
times, so their latencies and throughputs compare like for like.

* ``from_prompts``: prompts (text, optional answer) shuffled by the seed; each request's output
  length is ``output_len`` when given, else the answer's token count, capped by
  ``max_output_len`` (a prompt without an answer gets ``max_output_len``: the shared ShareGPT
  files hold first turns only); the prompt keeps its first tokens when it would not fit the
  context with its output; with ``input_len`` it is cut or repeated to exactly that many tokens.
* ``from_corpus``: ``num`` windows of ``input_len`` tokens at seeded offsets of a text (the
  embedded training corpus when the user gives no prompts).
* ``phase_requests``: a phase's ``[{"at", "prompt", "max_tokens"}]`` for the load client.
* ``arrivals_for``: Poisson arrival times for a number of requests or a duration.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Optional, Sequence

from megatron.common.cli import UserError

from .loadgen import poisson_arrivals

__all__ = ["Request", "from_prompts", "from_corpus", "arrivals_for", "phase_requests"]


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple  # token ids
    max_tokens: int


def _fit(tokens: list, input_len: Optional[int]) -> list:
    if input_len is None:
        return tokens
    reps = math.ceil(input_len / len(tokens))
    return (tokens * reps)[:input_len]


def from_prompts(pairs: Sequence[tuple], tokenize: Callable[[str], list], *, num: int, context: int, seed: int,
                 input_len: Optional[int] = None, output_len: Optional[int] = None,
                 max_output_len: int = 64) -> tuple[list, dict]:
    """``num`` requests from ``(prompt, answer or None)`` pairs (cycled when there are fewer) and
    ``{"truncated", "from_answers", "prompts_used"}`` (see the module docstring)."""
    if not pairs:
        raise UserError("--prompts: no prompts")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out, truncated, from_answers, cache = [], 0, 0, {}
    for i in range(num):
        k = order[i % len(order)]
        if k not in cache:
            text, answer = pairs[k]
            tokens = list(tokenize(text))
            if not tokens:
                cache[k] = None
                continue
            if output_len is not None:
                out_len = output_len
            elif answer is not None:
                out_len = min(max(len(tokenize(answer)), 1), max_output_len)
                from_answers += 1
            else:
                out_len = max_output_len
            tokens = _fit(tokens, input_len)
            if len(tokens) + out_len > context:
                if input_len is not None:
                    raise UserError(f"--input-len {input_len} + output {out_len} tokens exceed the model's context "
                                    f"of {context} tokens")
                tokens = tokens[:context - out_len]
                truncated += 1
            cache[k] = Request(tuple(int(t) for t in tokens), int(out_len))
        if cache[k] is not None:
            out.append(cache[k])
    if not out:
        raise UserError("--prompts: every prompt tokenizes to nothing")
    valid = list(out)
    while len(out) < num:  # prompts that tokenized to nothing were skipped: cycle the others
        out.append(valid[len(out) % len(valid)])
    return out, {"truncated": truncated, "from_answers": from_answers, "prompts_used": len(cache)}


def from_corpus(text: str, tokenize: Callable[[str], list], *, num: int, input_len: int, output_len: int,
                context: int, seed: int) -> list:
    """``num`` requests of ``input_len`` tokens taken at seeded offsets of ``text``."""
    if input_len + output_len > context:
        raise UserError(f"--input-len {input_len} + --output-len {output_len} exceed the model's context of "
                        f"{context} tokens")
    tokens = list(tokenize(text))
    if len(tokens) < input_len + 1:
        raise UserError(f"the corpus has only {len(tokens)} tokens, fewer than --input-len {input_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(tokens) - input_len) for _ in range(num)]
    return [Request(tuple(int(t) for t in tokens[s:s + input_len]), int(output_len)) for s in starts]


def arrivals_for(rate: float, seed: int, *, num: Optional[int] = None, duration_s: Optional[float] = None) -> list:
    """Poisson arrival times at ``rate`` requests/s: ``num`` of them, or those before ``duration_s``."""
    if (num is None) == (duration_s is None):
        raise UserError("give either --num-requests or --duration")
    if num is not None:
        return poisson_arrivals(rate, num, seed)
    if math.isinf(rate):
        raise UserError("--duration needs finite --request-rates")
    expected = rate * duration_s
    times = poisson_arrivals(rate, int(expected + 10 * math.sqrt(expected) + 10), seed)
    return [t for t in times if t < duration_s]


def phase_requests(requests: Sequence[Request], arrivals: Sequence[float]) -> list:
    """The load client's request list: request ``i % len(requests)`` at ``arrivals[i]``."""
    return [{"at": float(t), "prompt": list(requests[i % len(requests)].prompt),
             "max_tokens": requests[i % len(requests)].max_tokens} for i, t in enumerate(arrivals)]
