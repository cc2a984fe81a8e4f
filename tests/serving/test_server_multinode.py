"""The server's ranks over two machines, here two torchrun agents on one: ``serve --nproc-per-node 1
--nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`` with ``--node-rank 0`` (the front end and one rank) and
``--node-rank 1`` (one rank), EP = 2 spanning the nodes. Node 1 starts first, so the rendezvous
(which orders the agents by host name, then process id) gives it rank 0: the engine reaches the
front end on node 0 over TCP with the address and key it took from node 0's rank.

Greedy tokens are compared exactly with ``evaluate_lm``'s offline generation (as
``test_server_ep``: the same model at EP = 1; no timing asserted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.serving.conftest import PROMPTS, REPO, Server, offline_greedy, post

MAX_NEW = 12


@pytest.mark.slow
def test_server_on_two_nodes_answers_as_one(serve_ckpts, tmp_path):
    from tests.helpers import kill_agent
    from tools.bench.launcher import free_port

    ckpt = serve_ckpts["standard"]
    prompts = PROMPTS[:3]
    reference, _ = offline_greedy(ckpt, prompts, MAX_NEW)
    nodes = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--expert-model-parallel-size", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    with open(tmp_path / "node1.log", "w+") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "megatron.inference.serve", "--load", ckpt, "--port", "0",
                                  "--nproc-per-node", "1", "--node-rank", "1", *nodes], cwd=REPO, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        srv = None
        try:
            srv = Server(ckpt, tmp_path, nproc=1, frontend_process=True, extra=["--node-rank", "0", *nodes])
            assert srv.info["world_size"] == 2 and srv.info["expert_model_parallel_size"] == 2
            tokens = []
            for prompt in prompts:
                status, body = post(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW,
                                                                 "temperature": 0, "return_token_ids": True})
                assert status == 200, body
                tokens.append(body["choices"][0]["token_ids"])
            assert tokens == [t for t, _ in reference]
            # SIGTERM to the front end alone: it drains and stops the engine, and every node's ranks
            # and agent end with 0
            os.kill(srv.proc.pid, signal.SIGTERM)
            assert srv.proc.wait(timeout=90) == 0 and node1.wait(timeout=90) == 0
        finally:
            if srv is not None:
                srv.stop()
            kill_agent(node1)
        log.seek(0)
        node1_log = log.read()
    # rank 0 ran on node 1 and linked to node 0's front end over TCP
    assert "engine serving standard through the front end at 127.0.0.1:" in node1_log, node1_log[-3000:]
    assert "serving standard on http://127.0.0.1:" in srv.output()
