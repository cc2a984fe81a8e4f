"""How the front end answers a generation request from the engine's token updates: a JSON body
once every choice has finished, or server-sent events as the tokens arrive (``respond``).

Each update is taken into its choice (``absorb``): the end-of-document token, ``stop_token_ids``
and stop strings end it (the engine request is cancelled when it would go on), log-probs follow
their tokens. The request ends in a 504 once ``--request-timeout`` has passed since it arrived (its
engine requests cancelled), a 5xx when the engine fails it or stops serving (an error event and
``[DONE]`` once a stream has started), ``finish_reason: "abort"`` on a shutdown past
``--shutdown-timeout``, and silently when its client went away. Every finished request is counted in
the metrics (``record``). A request held while the engine restarts (``admission``) waits here like
any other: nothing reaches its client until the new engine's tokens do.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from megatron.inference import protocol
from megatron.inference.admission import Choice, Stream
from megatron.inference.protocol import BadRequest

__all__ = ["respond", "send_json", "read_body", "watch_disconnect"]


def absorb(frontend, req, choice: Choice, update) -> tuple:
    """Take one update into ``choice``: (visible text, token ids, log-prob entries) new to the
    client."""
    now = time.perf_counter()
    if update.tokens or update.finished:
        frontend.book.first_token(choice)
    if update.prompt_logprobs:
        choice.prompt_logprobs.extend(update.prompt_logprobs)
    new = list(update.tokens)
    entries = list(update.logprobs or [])[:len(new)]
    if new:
        choice.first_at = choice.first_at or now
        choice.last_at = now
    finish = None
    if update.finished and new and new[-1] == frontend.tokenizer.eod and not req.ignore_eos:
        new, finish = new[:-1], "stop"
    cut = next((k for k, t in enumerate(new) if t in req.stop_token_ids), None)
    if cut is not None:
        new, finish = new[:cut], "stop"
    # the token that ended the choice (EOD, a stop token id) is not in the text or token ids, but
    # keeps its log-prob entry, as OpenAI's and vLLM's: echo scoring (lm-eval's) reads one entry
    # past the prompt and would otherwise lose the prompt's last one
    entries = entries[:len(new) + (finish == "stop")]
    start = len(choice.tokens)
    choice.tokens.extend(new)
    choice.logprobs.extend(entries)
    piece = choice.text.push(new)
    if choice.text.stopped:
        finish = "stop"  # tokens after the one that completed the stop string are not reported
    elif update.finished and finish is None:
        finish = "length" if len(choice.tokens) >= req.max_tokens else "stop"
    if finish is not None and not update.finished:
        frontend.book.cancel(update.request_id)
    if finish is not None and not choice.text.stopped:
        piece += choice.text.finish()
    choice.finish = finish
    return piece, choice.tokens[start:], entries


def logprobs_of(frontend, req, choice: Choice, entries: list, *, with_prompt: bool, offset: int = 0):
    if req.logprobs is None:
        return None
    if req.chat:
        return protocol.chat_logprobs(entries, frontend.token_text)
    if with_prompt and req.echo:
        entries = [(choice.prompt[0], None, None)] + list(choice.prompt_logprobs) + list(entries)
    return protocol.completion_logprobs(entries, frontend.token_text, text_offset=offset)


async def respond(frontend, req, stream: Stream, send, chat: bool, arrival: float) -> None:
    """Answer ``req`` from ``stream``'s updates (module docstring); ``BadRequest`` for an error
    answered before a stream started."""
    book, tokenizer, model = frontend.book, frontend.tokenizer, frontend.served_model
    name = f"{'chatcmpl' if chat else 'cmpl'}-{stream.order}"
    timeout_s = frontend.config.request_timeout
    deadline = arrival + timeout_s if timeout_s > 0 else None
    error: Optional[BadRequest] = None
    aborted = disconnected = lost = False

    async def sse(payload: dict):
        if not stream.started:
            stream.started = True  # from here on it cannot be held
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                    *((k.encode(), v.encode()) for k, v in rank_header(stream).items())]})
        await send({"type": "http.response.body", "body": f"data: {json.dumps(payload)}\n\n".encode(),
                    "more_body": True})

    while stream.unfinished:
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
            item = await asyncio.wait_for(stream.updates.get(), timeout)
        except asyncio.TimeoutError:
            error = BadRequest(f"the request did not finish within --request-timeout {timeout_s:g} s", status=504,
                               code="timeout")
            book.cancel_unfinished(stream)
            break
        if item is None:  # the client went away
            book.cancel_unfinished(stream)
            disconnected = True
            break
        if item == "abort":
            aborted = True
            break
        if isinstance(item, tuple):  # ("dead", reason)
            error = BadRequest(f"the engine stopped serving: {item[1]}", status=503)
            lost = True
            break
        choice = stream.choices.get(item.request_id)
        if choice is None or choice.finish is not None:
            continue  # finished already, or from a lost engine (the choice was held and sent again)
        if item.failed:
            error = BadRequest(f"generation failed: {item.failed}", status=item.status)
            choice.finish = "error"
            book.cancel_unfinished(stream)
            break
        piece, ids, entries = absorb(frontend, req, choice, item)
        if not req.stream:
            continue
        if not choice.started:
            choice.started = True
            prefix = tokenizer.detokenize(choice.prompt) if req.echo else ""
            logprobs = logprobs_of(frontend, req, choice, entries, with_prompt=True)
            piece = prefix + piece
            role = chat
        else:
            logprobs = logprobs_of(frontend, req, choice, entries, with_prompt=False, offset=choice.offset)
            role = False
        if not piece and not ids and choice.finish is None and not role:
            continue
        if logprobs is not None and not chat:
            choice.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] \
                else choice.offset
        await sse(protocol.response(chat=chat, stream=True, rid=name, model=model, choices=[
            protocol.choice(chat=chat, stream=True, index=choice.index, text=piece, finish_reason=choice.finish,
                            token_ids=ids if req.return_token_ids and ids else None, logprobs=logprobs, role=role)]))

    record(frontend.metrics, stream, arrival,
           "lost" if lost else "failed" if error is not None and error.status != 504 else
           "timeout" if error is not None else "aborted" if (aborted or disconnected) else "completed")
    if disconnected:
        return
    if error is not None:
        if not stream.started:
            raise error
        await sse(protocol.error_body(error))
        return await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    choices = stream.all
    usage = (sum(len(c.prompt) for c in choices), sum(len(c.tokens) for c in choices))
    if not req.stream:
        body = [protocol.choice(chat=chat, stream=False, index=c.index,
                                text=(tokenizer.detokenize(c.prompt) if req.echo else "") + c.text.text,
                                finish_reason=c.finish or "abort",
                                token_ids=list(c.tokens) if req.return_token_ids else None,
                                logprobs=logprobs_of(frontend, req, c, c.logprobs, with_prompt=True)) for c in choices]
        stream.started = True
        return await send_json(send, 200, protocol.response(chat=chat, stream=False, rid=name, model=model,
                                                            choices=body, usage=usage), headers=rank_header(stream))
    for c in choices:
        if aborted and c.finish is None:
            await sse(protocol.response(chat=chat, stream=True, rid=name, model=model, choices=[
                protocol.choice(chat=chat, stream=True, index=c.index, text="", finish_reason="abort",
                                role=chat and not c.started)]))
    if req.include_usage:
        await sse(protocol.response(chat=chat, stream=True, rid=name, model=model, choices=[], usage=usage))
    if not stream.started:  # nothing was generated (e.g. aborted at once): still a well-formed stream
        await sse(protocol.response(chat=chat, stream=True, rid=name, model=model, choices=[]))
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def record(metrics, stream: Stream, arrival: float, status: str) -> None:
    """Count the finished request's choices in ``metrics`` with ``status``."""
    e2e = time.perf_counter() - arrival
    for c in stream.all:
        ttft = (c.first_at - arrival) if c.first_at is not None else None
        tpot = (c.last_at - c.first_at) / (len(c.tokens) - 1) if c.first_at is not None and len(c.tokens) > 1 \
            else None
        metrics.finished(status, prompt_tokens=len(c.prompt), generation_tokens=len(c.tokens), ttft_s=ttft,
                         tpot_s=tpot, e2e_s=e2e)


async def watch_disconnect(receive, stream: Stream) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.updates.put_nowait(None)
            return


async def read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected while sending the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes (--max-body-bytes)", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def rank_header(stream: Stream) -> dict:
    """``x-dp-rank``: the data-parallel engine of each choice, in choice order (comma-separated),
    once the loop has assigned them all; nothing before."""
    ranks = [c.dp_rank for c in stream.all]
    if not ranks or any(r is None for r in ranks):
        return {}
    return {"x-dp-rank": ",".join(str(r) for r in ranks)}


async def send_json(send, status: int, payload: dict, headers: Optional[dict] = None) -> None:
    body = json.dumps(payload).encode()
    extra = [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})
