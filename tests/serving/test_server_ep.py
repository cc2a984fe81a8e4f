"""The server on two torchrun ranks with expert parallelism (EP=2, attention data-parallel over
the two ranks, gloo, HTTP on 127.0.0.1 from rank 0): the same greedy tokens as EP=1 (evaluate_lm's
generation on one rank), one by one and concurrently; while only one rank has a request the
other runs the engine's dummy forwards so the expert all-to-alls line up, and the dispatchers'
byte counters reach /metrics. Exact token comparison; no timing asserted.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.serving.conftest import PROMPTS, Server, get_metrics, offline_greedy, post

MAX_NEW = 16


@pytest.mark.slow
def test_ep2_server_equals_ep1(serve_ckpts, tmp_path):
    reference, _ = offline_greedy(serve_ckpts["bigmac"], PROMPTS, MAX_NEW)
    srv = Server(serve_ckpts["bigmac"], tmp_path, nproc=2, extra=["--expert-model-parallel-size", "2"])
    try:
        assert srv.info["data_parallel_size"] == 2 and srv.info["expert_model_parallel_size"] == 2

        def complete(prompt):
            status, body = post(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW,
                                                             "temperature": 0, "return_token_ids": True})
            assert status == 200, body
            return body["choices"][0]["token_ids"]

        one_by_one = [complete(p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(complete, PROMPTS))
        expected = [t for t, _ in reference]
        assert one_by_one == expected and together == expected
        metrics = get_metrics(srv.url)
        # requests alternate between the ranks: each rank idled while the other decoded
        assert metrics['moe_serve_dummy_forwards_total{rank="0"}'] > 0
        assert metrics['moe_serve_dummy_forwards_total{rank="1"}'] > 0
        assert metrics['moe_serve_all_to_all_bytes_total{rank="0"}'] > 0
        assert metrics["moe_serve_all_to_all_bytes_per_token"] > 0
        assert metrics['moe_serve_kv_cache_blocks_used{rank="1"}'] == 0
    finally:
        srv.stop()  # torchrun's own exit code after SIGTERM is the agent's, not the ranks'
    assert "server stopped" in srv.output()


@pytest.mark.slow
def test_a_busy_port_is_one_line_at_two_ranks(serve_ckpts):
    """Rank 0 alone serves HTTP: a port in use is its one-line error before any rank starts, not
    rank 1 dying first in the serving loop's collective on the lost connection to rank 0."""
    import socket

    from tests.helpers import torchrun

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = torchrun("megatron.inference.serve", ["--load", serve_ckpts["bigmac"], "--port", port,
                                                     "--expert-model-parallel-size", 2])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megatron.inference.serve: error:")]
    expected = f"megatron.inference.serve: error: --host 127.0.0.1 --port {port}: cannot bind (Address already in use)"
    assert proc.returncode != 0
    assert lines == [expected], proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-2:]  # torchrun's summary ends with it
    assert any(line.endswith(expected) for line in last), proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr
