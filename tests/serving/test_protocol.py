"""Request validation, visible text with stop strings, chat templates and the metrics format
(pure functions of megatron/inference; exact comparisons)."""

import pytest

from megatron.inference import protocol as P
from megatron.inference.metrics import Histogram, ServingMetrics, parse_metrics


def _tok(text):  # one id per character
    return [ord(c) for c in text]


def _detok(ids):
    return "".join(chr(i) for i in ids)


def _completion(body, context=32):
    return P.parse_completion(body, tokenize=_tok, served_model="m", context=context)


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
    ({"prompt": "a", "logprobs": 2}, 400, "logprobs"),
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
    req = P.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, render=P.simple_chat_prompt,
                       tokenize=_tok, served_model="m", context=40)
    assert _detok(req.prompt_tokens) == "user: hi\nassistant:"
    assert req.max_tokens == 40 - len("user: hi\nassistant:")
    with pytest.raises(P.BadRequest):
        P.parse_chat({"messages": [{"role": "user"}]}, render=P.simple_chat_prompt, tokenize=_tok,
                     served_model="m", context=40)


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
