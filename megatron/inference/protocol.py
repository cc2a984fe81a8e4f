"""The OpenAI-compatible request/response format of the server, as pure functions (no torch).

``parse_completion`` / ``parse_chat`` validate a decoded JSON body into a ``GenerationRequest`` or
raise ``BadRequest`` (HTTP status + one-line message + the offending parameter). ``StopText``
turns a growing list of generated tokens into text the client may see: cut before the first stop
string, holding back a tail that could still become one and an incomplete UTF-8 sequence, so a
stream never shows text that the final answer does not contain. ``completion_body`` /
``completion_chunk`` / ``chat_body`` / ``chat_chunk`` build the response objects.

Chat prompts use the tokenizer's chat template when the checkpoint has one (``chat_template`` in
a ``tokenizer_config.json`` beside its ``tokenizer.json``, rendered with Jinja2 as transformers
does); otherwise ``SIMPLE_CHAT_TEMPLATE``: one ``<role>: <content>`` line per message, then
``assistant:``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional, Sequence

__all__ = [
    "BadRequest",
    "GenerationRequest",
    "parse_completion",
    "parse_chat",
    "StopText",
    "simple_chat_prompt",
    "ChatTemplate",
    "completion_body",
    "completion_chunk",
    "chat_body",
    "chat_chunk",
    "error_body",
    "DEFAULT_COMPLETION_MAX_TOKENS",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4

# Fields accepted with their default (a request giving another value for a field we do not
# implement is refused rather than silently ignored).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "user", "return_token_ids", "ignore_eos", "logprobs", "presence_penalty",
           "frequency_penalty", "logit_bias"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
_UNIMPLEMENTED_DEFAULTS = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "logprobs": None,
                           "top_logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
                           "logit_bias": None}


class BadRequest(ValueError):
    """A request the server refuses: ``status`` (4xx), a one-line ``message``, the ``param``."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message.splitlines()[0] if message else "bad request")
        self.status = status
        self.param = param
        self.code = code


@dataclasses.dataclass
class GenerationRequest:
    """One validated request (token ids, not text)."""

    prompt_tokens: list
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False
    chat: bool = False


def decode_json(body: bytes) -> dict:
    """The request body as a JSON object, or ``BadRequest``."""
    try:
        value = json.loads(body.decode("utf-8") if body else "")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise BadRequest("the request body must be a JSON object")
    return value


def _number(body: dict, name: str, default, *, lo=None, hi=None, integer=False, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind}, got {json.dumps(value)}", param=name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {value}", param=name)
    return value


def _common(body: dict, allowed: set, served_model: str) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]}", param=unknown[0])
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(f"the model '{model}' does not exist (this server serves '{served_model}')",
                         status=404, param="model", code="model_not_found")
    for name, default in _UNIMPLEMENTED_DEFAULTS.items():
        if name in allowed and body.get(name, default) not in (default, None) and \
                not (name == "logprobs" and body.get(name) is False):
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
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("'stream_options' may only hold 'include_usage'", param="stream_options")
    if options and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {json.dumps(seed)}", param="seed")
    token_ids = body.get("return_token_ids", False)
    if not isinstance(token_ids, bool):
        raise BadRequest("'return_token_ids' must be true or false", param="return_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be true or false", param="ignore_eos")
    return dict(
        temperature=float(_number(body, "temperature", 1.0, lo=0.0, hi=2.0)),
        top_p=float(_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        top_k=int(_number(body, "top_k", 0, lo=0, integer=True)),
        seed=seed, stop=stop, stream=stream, include_usage=bool(options.get("include_usage", False)),
        return_token_ids=token_ids, ignore_eos=ignore_eos,
    )


def _max_tokens(body: dict, names: Sequence[str], default: Optional[int]) -> Optional[int]:
    for name in names:
        if body.get(name) is not None:
            return int(_number(body, name, None, lo=1, integer=True))
    return default


def _check_length(prompt_len: int, max_tokens: Optional[int], context: int) -> int:
    if prompt_len == 0:
        raise BadRequest("the prompt is empty", param="prompt")
    if max_tokens is None:
        max_tokens = context - prompt_len
        if max_tokens < 1:
            raise BadRequest(f"the prompt has {prompt_len} tokens: no room left in the model's context "
                             f"of {context} tokens", param="messages")
    if prompt_len + max_tokens > context:
        raise BadRequest(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                         f"more than the model's context of {context} tokens", param="max_tokens",
                         code="context_length_exceeded")
    return max_tokens


def parse_completion(body: dict, *, tokenize, served_model: str, context: int) -> GenerationRequest:
    """``/v1/completions``: ``prompt`` is a string or a list of token ids (one prompt per request)."""
    common = _common(body, _COMPLETION_FIELDS, served_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = list(tokenize(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = list(prompt)
    elif prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    else:
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)",
                         param="prompt")
    max_tokens = _max_tokens(body, ["max_tokens"], DEFAULT_COMPLETION_MAX_TOKENS)
    max_tokens = _check_length(len(tokens), max_tokens, context)
    return GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, **common)


def parse_chat(body: dict, *, render, tokenize, served_model: str, context: int) -> GenerationRequest:
    """``/v1/chat/completions``: ``messages`` rendered by ``render(messages) -> str``."""
    common = _common(body, _CHAT_FIELDS, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'",
                             param="messages")
    tokens = list(tokenize(render(messages)))
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], None)
    max_tokens = _check_length(len(tokens), max_tokens, context)
    return GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, chat=True, **common)


# --- chat prompts ---------------------------------------------------------------------------

SIMPLE_CHAT_TEMPLATE = "one '<role>: <content>' line per message, then 'assistant:'"


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


def completion_body(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, token_ids: Optional[list] = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, text: str, finish_reason: Optional[str] = None,
                     usage: Optional[tuple] = None, token_ids: Optional[list] = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = _usage(*usage)
        return chunk
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk["choices"] = [choice]
    return chunk


def chat_body(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
              completion_tokens: int, token_ids: Optional[list] = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
              "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: Optional[str] = None,
               usage: Optional[tuple] = None, token_ids: Optional[list] = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    if usage is not None:
        chunk["choices"] = []
        chunk["usage"] = _usage(*usage)
        return chunk
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk["choices"] = [choice]
    return chunk
