"""The OpenAI-compatible request/response format of the server, as pure functions (no I/O, no tensors).

``parse_completion`` / ``parse_chat`` validate a decoded JSON body into a ``GenerationRequest``
or raise ``BadRequest`` (HTTP status + one-line message + the offending parameter). They refuse,
with the parameter named, everything the engine could not serve, so that a request that passes
cannot fail inside the engine: token ids outside the vocabulary, ``top_k`` above it, a ``seed``
outside what ``torch.Generator`` takes, a prompt that with ``max_tokens`` does not fit the context
or the KV cache one request can hold (``Limits``), more log-probs than ``MAX_LOGPROBS``.
``top_k`` and ``top_p`` together both apply (top-k first, as vLLM does).

``StopText`` turns a growing list of generated tokens into text the client may see: cut before
the first stop string, holding back a tail that could still become one and an incomplete UTF-8
sequence, so a stream never shows text that the final answer does not contain. ``response`` and
``choice`` build every response object (completions and chat, whole and streamed);
``completion_logprobs`` / ``chat_logprobs`` shape log-probs as vLLM does (-inf sent as -9999.0;
the first prompt token of ``echo`` has none). ``parse_tokenize`` / ``parse_detokenize`` serve
vLLM's tokenizer endpoints (what lm-eval's remote tokenizer calls).

Chat prompts use the tokenizer's chat template when the checkpoint has one (``chat_template`` in
a ``tokenizer_config.json`` beside its ``tokenizer.json``, rendered with Jinja2 as transformers
does); otherwise ``SIMPLE_CHAT_TEMPLATE``: one ``<role>: <content>`` line per message, then
``assistant:``. A message's ``content`` is a string or a list of text parts (joined by newlines).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable, Optional, Sequence

from megatron.inference.sampling import MAX_LOGPROBS, RequestSampling

__all__ = [
    "BadRequest",
    "Limits",
    "GenerationRequest",
    "decode_json",
    "parse_completion",
    "parse_chat",
    "parse_tokenize",
    "parse_detokenize",
    "StopText",
    "simple_chat_prompt",
    "ChatTemplate",
    "SIMPLE_CHAT_JINJA",
    "choice",
    "response",
    "completion_logprobs",
    "chat_logprobs",
    "error_body",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_LOGPROBS",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a batch: one choice each)
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf (vLLM's stand-in)

# Fields accepted with their default (a request giving another value for a field we do not
# implement is refused rather than silently ignored).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
           "stream_options", "n", "user", "return_token_ids", "ignore_eos", "logprobs", "presence_penalty",
           "frequency_penalty", "logit_bias"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
_UNIMPLEMENTED_DEFAULTS = {"n": 1, "best_of": 1, "suffix": None, "presence_penalty": 0, "frequency_penalty": 0,
                           "logit_bias": None}


class BadRequest(ValueError):
    """A request the server refuses: ``status`` (4xx; 5xx for the server's own failures), a
    one-line ``message``, the ``param``; ``headers`` to send with it (e.g. ``Retry-After``)."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message.splitlines()[0] if message else "bad request")
        self.status = status
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and engine can take."""

    context: int  # prompt + output tokens (the engine's max sequence length)
    vocab_size: int  # token ids are in [0, vocab_size)
    max_request_tokens: Optional[int] = None  # prompt + output tokens one request's KV blocks hold
    max_logprobs: int = MAX_LOGPROBS


@dataclasses.dataclass
class GenerationRequest:
    """One validated request (token ids, not text): one or more prompts (one choice each) with
    shared options."""

    prompts: list  # [[token ids], ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list = dataclasses.field(default_factory=list)
    stop_token_ids: list = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False
    chat: bool = False
    logprobs: Optional[int] = None  # None: none; N: the chosen token's and N alternatives
    echo: bool = False  # completions: the prompt (and with logprobs its log-probs) before the output

    @property
    def prompt_tokens(self) -> list:
        """The first (for chat: the only) prompt."""
        return self.prompts[0]

    def sampling(self) -> RequestSampling:
        return RequestSampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                               logprobs=self.logprobs, prompt_logprobs=self.echo and self.logprobs is not None)


def decode_json(body: bytes) -> dict:
    """The request body as a JSON object, or ``BadRequest``."""
    try:
        value = json.loads(body.decode("utf-8") if body else "")
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise BadRequest(f"the request body is not valid JSON ({str(err).splitlines()[0] or type(err).__name__})") \
            from None
    if not isinstance(value, dict):
        raise BadRequest("the request body must be a JSON object")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind}, got {_short(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{name}' must be finite, got {value}", param=name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {value}", param=name)
    return value


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", param=name)
    return value


def _token_ids(value, name: str, vocab_size: int) -> list:
    """A list of token ids in [0, vocab_size), or ``BadRequest`` naming ``name``."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"'{name}' must be a list of integer token ids", param=name)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"'{name}' holds token id {bad}, outside the vocabulary [0, {vocab_size})", param=name)
    return list(value)


def _check_model(body: dict, served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(f"the model {_short(model)} does not exist (this server serves '{served_model}')",
                         status=404, param="model", code="model_not_found")


def _common(body: dict, allowed: set, served_model: str, limits: Limits) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument: {_short(unknown[0])}", param=unknown[0])
    _check_model(body, served_model)
    for name, default in _UNIMPLEMENTED_DEFAULTS.items():
        if name in allowed and body.get(name, default) not in (default, None):
            raise BadRequest(f"'{name}' is not supported by this server (only {json.dumps(default)})", param=name)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", limits.vocab_size)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}",
                         param="stop_token_ids")
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("'stream_options' may only hold 'include_usage'", param="stream_options")
    if options and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("'stream_options.include_usage' must be true or false", param="stream_options")
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise BadRequest(f"'seed' must be an integer, got {_short(seed)}", param="seed")
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise BadRequest(f"'seed' must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}", param="seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    top_k = int(_number(body, "top_k", 0, lo=-1, hi=limits.vocab_size, integer=True))
    return dict(
        temperature=float(_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
        top_p=float(_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        top_k=max(top_k, 0),  # -1: no top-k (vLLM's spelling)
        seed=seed, stop=stop, stop_token_ids=stop_ids, stream=stream, include_usage=include_usage,
        return_token_ids=_flag(body, "return_token_ids"), ignore_eos=_flag(body, "ignore_eos"),
    )


def _max_tokens(body: dict, names: Sequence[str], default: Optional[int]) -> Optional[int]:
    for name in names:
        if body.get(name) is not None:
            return int(_number(body, name, None, lo=1, integer=True))
    return default


def _check_length(prompt_len: int, max_tokens: Optional[int], limits: Limits, param: str = "prompt") -> int:
    if prompt_len == 0:
        raise BadRequest("the prompt is empty", param=param)
    context = limits.context
    if max_tokens is None:
        max_tokens = context - prompt_len
        if limits.max_request_tokens is not None:
            max_tokens = min(max_tokens, limits.max_request_tokens - prompt_len)
        if max_tokens < 1:
            raise BadRequest(f"the prompt has {prompt_len} tokens: no room left in the model's context of "
                             f"{context} tokens (KV cache per request: {limits.max_request_tokens})", param=param,
                             code="context_length_exceeded")
    if prompt_len + max_tokens > context:
        raise BadRequest(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                         f"more than the model's context of {context} tokens", param="max_tokens",
                         code="context_length_exceeded")
    if limits.max_request_tokens is not None and prompt_len + max_tokens > limits.max_request_tokens:
        raise BadRequest(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together more "
                         f"than the {limits.max_request_tokens} tokens of KV cache one request can hold "
                         "(--kv-cache-gb)", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _prompts(body: dict, tokenize: Callable, vocab_size: int) -> list:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [list(tokenize(prompt))]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [_token_ids(prompt, "prompt", vocab_size)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request",
                             param="prompt")
        return [list(tokenize(p)) if isinstance(p, str) else _token_ids(p, "prompt", vocab_size) for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those", param="prompt")


def parse_completion(body: dict, *, tokenize, served_model: str, limits: Limits) -> GenerationRequest:
    """``/v1/completions``: ``prompt`` is a string, a list of token ids, or a list of those (a
    batch: one choice per prompt, in order)."""
    common = _common(body, _COMPLETION_FIELDS, served_model, limits)
    logprobs = body.get("logprobs")
    if logprobs is False:
        logprobs = None
    if logprobs is not None:
        logprobs = int(_number(body, "logprobs", None, lo=0, hi=limits.max_logprobs, integer=True))
    echo = _flag(body, "echo")
    prompts = _prompts(body, tokenize, limits.vocab_size)
    max_tokens = _max_tokens(body, ["max_tokens"], DEFAULT_COMPLETION_MAX_TOKENS)
    for tokens in prompts:
        _check_length(len(tokens), max_tokens, limits)
    return GenerationRequest(prompts=prompts, max_tokens=max_tokens, logprobs=logprobs, echo=echo, **common)


def chat_messages(messages) -> list:
    """``messages`` with every ``content`` a string (a list of text parts is joined by newlines,
    as vLLM does), or ``BadRequest``."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 "supported", param="messages")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**message, "content": content})
    return out


def parse_chat(body: dict, *, render, tokenize, served_model: str, limits: Limits) -> GenerationRequest:
    """``/v1/chat/completions``: ``messages`` rendered by ``render(messages) -> str``."""
    common = _common(body, _CHAT_FIELDS, served_model, limits)
    messages = chat_messages(body.get("messages"))
    want = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = int(_number(body, "top_logprobs", None, lo=0, hi=limits.max_logprobs, integer=True))
        if not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tokens = list(tokenize(render(messages)))
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], None)
    max_tokens = _check_length(len(tokens), max_tokens, limits, param="messages")
    return GenerationRequest(prompts=[tokens], max_tokens=max_tokens, chat=True,
                             logprobs=(top or 0) if want else None, **common)


def parse_tokenize(body: dict, *, render, tokenize, served_model: str) -> list:
    """``POST /tokenize`` (vLLM's shape): the token ids of ``prompt`` (a string) or of
    ``messages`` rendered as a chat prompt."""
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                  "return_token_strs"})
    if unknown:
        raise BadRequest(f"unrecognized request argument: {_short(unknown[0])}", param=unknown[0])
    _check_model(body, served_model)
    for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        _flag(body, name)
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise BadRequest("'prompt' must be a string", param="prompt")
        return list(tokenize(body["prompt"]))
    return list(tokenize(render(chat_messages(body["messages"]))))


def parse_detokenize(body: dict, *, served_model: str, vocab_size: int) -> list:
    """``POST /detokenize`` (vLLM's shape): ``tokens``, ids in the vocabulary."""
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise BadRequest(f"unrecognized request argument: {_short(unknown[0])}", param=unknown[0])
    _check_model(body, served_model)
    if "tokens" not in body:
        raise BadRequest("'tokens' is required", param="tokens")
    return _token_ids(body["tokens"], "tokens", vocab_size)


# --- chat prompts ---------------------------------------------------------------------------

SIMPLE_CHAT_TEMPLATE = "one '<role>: <content>' line per message, then 'assistant:'"


# the same template in Jinja2, for clients that render prompts themselves (``/tokenizer_info``)
SIMPLE_CHAT_JINJA = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


def simple_chat_prompt(messages: Sequence[dict]) -> str:
    """The documented fallback template (``SIMPLE_CHAT_TEMPLATE``)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class ChatTemplate:
    """A tokenizer's Jinja2 chat template (``tokenizer_config.json``'s ``chat_template``)."""

    def __init__(self, template: str, special_tokens: Optional[dict] = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.source = template
        self._template = env.from_string(template)
        self._special = dict(special_tokens or {})

    def __call__(self, messages: Sequence[dict]) -> str:
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True, **self._special)
        except Exception as err:  # the template's own raise_exception, or a malformed conversation
            raise BadRequest(f"the chat template refused the messages: {str(err).splitlines()[0]}",
                             param="messages") from None

    @classmethod
    def from_tokenizer_dir(cls, directory: str) -> Optional["ChatTemplate"]:
        """The template of ``directory/tokenizer_config.json``, or None when it has none."""
        import os

        path = os.path.join(directory, "tokenizer_config.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            return None
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(template, special)


# --- generated text -------------------------------------------------------------------------


class StopText:
    """The visible text of a growing generation (see the module docstring).

    ``push(tokens)`` adds tokens and returns the new visible text; ``stopped`` tells whether a
    stop string was met (the text is then final, cut before it); ``finish()`` returns what was
    held back once no more tokens will come.
    """

    def __init__(self, detokenize, stop: Sequence[str]):
        self._detokenize = detokenize
        self.stop = [s for s in stop if s]
        self.tokens: list = []
        self.emitted = ""
        self.stopped = False
        self.text = ""  # the full visible text so far (final once stopped or finished)

    def _visible(self) -> tuple[str, bool]:
        text = self._detokenize(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        return text, False

    def push(self, tokens: Sequence[int]) -> str:
        if self.stopped or not tokens:
            return ""
        self.tokens.extend(int(t) for t in tokens)
        text, self.stopped = self._visible()
        self.text = text
        if self.stopped:
            return self._take(text)
        safe = len(text)
        for s in self.stop:  # a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        while safe > 0 and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        return self._take(text[:safe])

    def finish(self) -> str:
        return self._take(self.text)

    def _take(self, text: str) -> str:
        if not text.startswith(self.emitted):  # a later token re-decoded earlier bytes
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new


# --- responses ------------------------------------------------------------------------------


def error_body(err: BadRequest) -> dict:
    return {"error": {"message": str(err), "type": "invalid_request_error" if err.status < 500 else "server_error",
                      "param": err.param, "code": err.code}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(*, chat: bool, stream: bool, index: int, text: str, finish_reason: Optional[str] = None,
           token_ids: Optional[list] = None, logprobs: Optional[dict] = None, role: bool = False) -> dict:
    """One choice: completions ``text``; chat ``message`` (whole) or ``delta`` (streamed; ``role``
    in the first delta)."""
    if not chat:
        out = {"index": index, "text": text}
    elif stream:
        delta = {"role": "assistant"} if role else {}
        if text or role:
            delta["content"] = text
        out = {"index": index, "delta": delta}
    else:
        out = {"index": index, "message": {"role": "assistant", "content": text}}
    out["logprobs"] = logprobs
    out["finish_reason"] = finish_reason
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def response(*, chat: bool, stream: bool, rid: str, model: str, choices: list,
             usage: Optional[tuple] = None) -> dict:
    """A whole response (``stream`` False) or one streamed chunk; ``usage`` (prompt, completion
    tokens) in a whole response, or alone in the last chunk (``choices`` empty)."""
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = _usage(*usage)
    return out


def _lp(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    return NEG_INF_LOGPROB if value == -math.inf else float(value)


def _top_dict(entry, token_text: Callable[[int], str]) -> Optional[dict]:
    token, lp, top = entry
    if lp is None:
        return None
    out: dict = {}
    for tid, value in list(top) + [(token, lp)]:  # the chosen token is always in (vLLM)
        key = token_text(tid)
        out[key] = max(out.get(key, -math.inf), _lp(value))  # ids that decode alike share a key
    return out


def completion_logprobs(entries: Sequence, token_text: Callable[[int], str], text_offset: int = 0) -> dict:
    """``choices[].logprobs`` of /v1/completions for ``(token id, log-prob or None, top)``
    entries: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the chosen token's and its
    alternatives', keyed by text) and ``text_offset`` (from ``text_offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for entry in entries:
        text = token_text(entry[0])
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(entry[1]))
        out["top_logprobs"].append(_top_dict(entry, token_text))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: Sequence, token_text: Callable[[int], str]) -> dict:
    """``choices[].logprobs`` of /v1/chat/completions: ``content``, one
    ``{token, logprob, bytes, top_logprobs}`` per generated token."""

    def item(tid, lp):
        text = token_text(tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, v) for a, v in top]} for t, lp, top in entries]}
