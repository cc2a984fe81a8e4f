"""Request validation, visible text with stop strings, chat templates, log-prob and response
shapes and the metrics format (pure functions of megatron/inference; exact comparisons)."""

import pytest

from megatron.inference import protocol as P
from megatron.inference.metrics import Histogram, ServingMetrics, parse_metrics


def _tok(text):  # one id per character
    return [ord(c) for c in text]


def _detok(ids):
    return "".join(chr(i) for i in ids)


VOCAB = 300  # _tok's ids of plain text are below 256


def _limits(context=32, kv=None):
    return P.Limits(context=context, vocab_size=VOCAB, max_request_tokens=kv)


def _completion(body, context=32, kv=None):
    return P.parse_completion(body, tokenize=_tok, served_model="m", limits=_limits(context, kv))


def _chat(body, context=40):
    return P.parse_chat(body, render=P.simple_chat_prompt, tokenize=_tok, served_model="m", limits=_limits(context))


def test_completion_defaults_and_fields():
    req = _completion({"prompt": "abc"})
    assert (req.prompt_tokens, req.max_tokens, req.temperature, req.top_p, req.stop) == ([97, 98, 99], 16, 1.0, 1.0, [])
    req = _completion({"model": "m", "prompt": [5, 6], "max_tokens": 3, "temperature": 0, "top_p": 0.5,
                       "seed": 7, "stop": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert (req.prompt_tokens, req.max_tokens, req.temperature, req.seed, req.stop, req.include_usage) == \
        ([5, 6], 3, 0.0, 7, ["x"], True)
    assert not req.ignore_eos and _completion({"prompt": "a", "ignore_eos": True}).ignore_eos


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "a" * 30, "max_tokens": 3}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "a", "echo": 1}, 400, "echo"),
    ({"prompt": [1, VOCAB]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": [[1, 2], [5, 10**6]]}, 400, "prompt"),
    ({"prompt": [True, 2]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a"] * 65}, 400, "prompt"),
    ({"prompt": "a", "top_k": VOCAB + 1}, 400, "top_k"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k"),
    ({"prompt": "a", "seed": 2**64}, 400, "seed"),
    ({"prompt": "a", "seed": -2**63 - 1}, 400, "seed"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed"),
    ({"prompt": "a", "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": "a", "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": "1"}, 400, "stop_token_ids"),
    ({"prompt": "a", "user": 3}, 400, "user"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ({"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "a", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_bad_completion_requests(body, status, param):
    with pytest.raises(P.BadRequest) as err:
        _completion(body)
    assert err.value.status == status and err.value.param == param
    assert "\n" not in str(err.value)


def test_malformed_json_is_a_bad_request():
    for body in (b"{bad", b"[1, 2]", b"\xff"):
        with pytest.raises(P.BadRequest):
            P.decode_json(body)


def test_chat_default_max_tokens_fills_the_context():
    req = _chat({"messages": [{"role": "user", "content": "hi"}]})
    assert _detok(req.prompt_tokens) == "user: hi\nassistant:"
    assert req.max_tokens == 40 - len("user: hi\nassistant:")
    with pytest.raises(P.BadRequest):
        _chat({"messages": [{"role": "user"}]})


def test_chat_content_parts_logprobs_and_refusals():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert _detok(_chat(parts).prompt_tokens) == "user: a\nb\nassistant:"
    assert _chat({**parts, "logprobs": True}).logprobs == 0
    assert _chat({**parts, "logprobs": True, "top_logprobs": 3}).logprobs == 3
    assert _chat(parts).logprobs is None
    for bad, param in [({**parts, "top_logprobs": 2}, "top_logprobs"),
                       ({**parts, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                        "messages"),
                       ({"messages": [{"role": "user", "content": 3}]}, "messages"),
                       ({**parts, "echo": True}, "echo")]:
        with pytest.raises(P.BadRequest) as err:
            _chat(bad)
        assert err.value.param == param, bad


def test_batch_prompts_echo_logprobs_stop_ids_and_sampling():
    req = _completion({"prompt": ["ab", [5, 6, 7]], "max_tokens": 2, "logprobs": 3, "echo": True,
                       "stop_token_ids": [9], "top_k": 4, "top_p": 0.5, "seed": -5, "temperature": 0.7})
    assert req.prompts == [[97, 98], [5, 6, 7]] and req.stop_token_ids == [9]
    spec = req.sampling()
    assert (spec.top_k, spec.top_p, spec.seed, spec.logprobs, spec.prompt_logprobs) == (4, 0.5, -5, 3, True)
    assert not _completion({"prompt": "a", "echo": True}).sampling().prompt_logprobs  # echo alone: text only
    assert _completion({"prompt": "a", "top_k": -1}).top_k == 0  # vLLM's "no top-k"
    assert _completion({"prompt": "a", "logprobs": False}).logprobs is None
    assert _completion({"prompt": "a", "seed": 2**64 - 1}).seed == 2**64 - 1


def test_kv_cache_limit_is_checked_per_request():
    assert _completion({"prompt": "abc", "max_tokens": 5}, kv=8).max_tokens == 5
    with pytest.raises(P.BadRequest) as err:
        _completion({"prompt": "abc", "max_tokens": 6}, kv=8)
    assert err.value.param == "max_tokens" and "KV cache" in str(err.value)
    # chat's default max_tokens stops at the KV limit
    req = P.parse_chat({"messages": [{"role": "u", "content": ""}]}, render=P.simple_chat_prompt, tokenize=_tok,
                       served_model="m", limits=P.Limits(context=40, vocab_size=VOCAB, max_request_tokens=20))
    assert len(req.prompt_tokens) + req.max_tokens == 20


def test_tokenize_and_detokenize_bodies():
    kw = dict(render=P.simple_chat_prompt, tokenize=_tok, served_model="m")
    assert P.parse_tokenize({"prompt": "ab", "add_special_tokens": False}, **kw) == [97, 98]
    assert _detok(P.parse_tokenize({"messages": [{"role": "u", "content": "x"}]}, **kw)) == "u: x\nassistant:"
    assert P.parse_detokenize({"tokens": [97]}, served_model="m", vocab_size=VOCAB) == [97]
    for body in ({}, {"prompt": "a", "messages": []}, {"prompt": 3}, {"prompt": "a", "model": "x"},
                 {"prompt": "a", "extra": 1}):
        with pytest.raises(P.BadRequest):
            P.parse_tokenize(body, **kw)
    for body in ({}, {"tokens": [VOCAB]}, {"tokens": [-1]}, {"tokens": "ab"}, {"tokens": [1], "x": 1}):
        with pytest.raises(P.BadRequest):
            P.parse_detokenize(body, served_model="m", vocab_size=VOCAB)


def test_logprob_shapes_match_vllm():
    text = {1: "a", 2: "bc", 3: "a"}.__getitem__
    entries = [(1, None, None), (2, -0.5, ((3, -0.25), (2, -0.5))), (3, float("-inf"), ((1, -0.1),))]
    out = P.completion_logprobs(entries, text, text_offset=4)
    assert out["tokens"] == ["a", "bc", "a"]
    assert out["token_logprobs"] == [None, -0.5, -9999.0]
    # the chosen token is always among top_logprobs; ids with the same text share a key (the larger value)
    assert out["top_logprobs"] == [None, {"a": -0.25, "bc": -0.5}, {"a": -0.1}]
    assert out["text_offset"] == [4, 5, 7]
    chat = P.chat_logprobs([(2, -0.5, ((3, -0.25),))], text)
    assert chat == {"content": [{"token": "bc", "logprob": -0.5, "bytes": [98, 99],
                                 "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]}]}


def test_one_response_builder_for_both_endpoints():
    whole = P.response(chat=False, stream=False, rid="c", model="m", usage=(2, 3), choices=[
        P.choice(chat=False, stream=False, index=0, text="hi", finish_reason="stop", token_ids=[1])])
    assert whole["object"] == "text_completion" and whole["usage"]["total_tokens"] == 5
    assert whole["choices"][0] == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop",
                                   "token_ids": [1]}
    chat = P.response(chat=True, stream=False, rid="c", model="m", choices=[
        P.choice(chat=True, stream=False, index=0, text="hi", finish_reason="length")])
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hi"}
    first = P.choice(chat=True, stream=True, index=1, text="", role=True)
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert P.choice(chat=True, stream=True, index=1, text="")["delta"] == {}
    usage = P.response(chat=True, stream=True, rid="c", model="m", choices=[], usage=(1, 1))
    assert usage["object"] == "chat.completion.chunk" and usage["choices"] == []


def test_simple_chat_template_in_jinja_renders_the_same():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi there"}]
    assert P.ChatTemplate(P.SIMPLE_CHAT_JINJA)(messages) == P.simple_chat_prompt(messages)


def test_chat_template_from_tokenizer_config(tmp_path):
    import json

    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    render = P.ChatTemplate.from_tokenizer_dir(str(tmp_path))
    assert render([{"role": "user", "content": "hi"}]) == "<|user|>hi</s><|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert P.ChatTemplate.from_tokenizer_dir(str(tmp_path)) is None


def test_stop_text_holds_back_a_possible_stop_string_and_cuts_before_it():
    text = P.StopText(_detok, ["END"])
    seen = "".join(text.push(_tok(c)) for c in "ab E")
    assert seen == "ab " and not text.stopped  # "E" may start "END"
    seen += text.push(_tok("x"))
    assert seen == "ab Ex"
    seen += text.push(_tok("yEN")) + text.push(_tok("Dzz"))
    assert text.stopped and seen == "ab Exy" and text.text == "ab Exy"
    assert text.push(_tok("more")) == ""


def test_stop_text_flushes_on_finish_and_never_emits_an_incomplete_character():
    text = P.StopText(_detok, [])
    assert text.push([ord("a"), 0xFFFD]) == "a"
    assert text.finish() == "\ufffd" and text.text == "a\ufffd"


def test_histogram_and_metrics_render():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    assert h.lines("x")[:3] == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1"} 2', 'x_bucket{le="+Inf"} 3']
    m = ServingMetrics("m")
    m.finished("completed", prompt_tokens=3, generation_tokens=4, ttft_s=0.2, tpot_s=0.01, e2e_s=0.3)
    m.rank_stats = [dict(requests_active=1, requests_waiting=0, kv_blocks_used=2, kv_blocks_total=10,
                         tokens_forwarded=100, steps=5, dummy_steps=0, busy_s=2.0, a2a_bytes=1000,
                         a2a_time_s=0.5, a2a_exposed_s=0.25, requests_added=3, local_activations=30,
                         routed_activations=40, activations_to_device=[[25, 15]])] * 2
    parsed = parse_metrics(m.render())
    assert parsed['moe_serve_requests_total{status="completed"}'] == 1
    assert parsed['moe_serve_kv_cache_blocks_used{rank="1"}'] == 2
    assert parsed["moe_serve_kv_cache_usage_ratio"] == 0.2
    assert parsed["moe_serve_all_to_all_bytes_per_token"] == 10.0
    assert parsed["moe_serve_local_activation_rate"] == 0.75
    assert parsed['moe_serve_requests_assigned_total{rank="1"}'] == 3
    assert parsed['moe_serve_expert_activations_total{layer="0",device="0"}'] == 50
    assert parsed['moe_serve_engine_busy_seconds_total{rank="0"}'] == 2.0
    assert parsed["moe_serve_time_to_first_token_seconds_count"] == 1
