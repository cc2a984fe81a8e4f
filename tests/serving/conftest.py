"""Tiny checkpoints, offline references and a server process for the serving tests.

Checkpoints: the lm-eval tests' 2-layer, 4-expert model (``tests/eval/conftest.save_tiny``, init std
0.5 so next-token distributions are peaked) with a 128-token context, as standard, BigMac and
FarSkip (all layers), and ``flat`` (standard with init std 0.02: near-uniform next-token
distributions, for the sampling tests). The server runs as a subprocess (``python -m megatron.inference.serve``, or
torchrun for several ranks) on 127.0.0.1 and a free port it picks itself (``--port 0
--ready-file``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LENGTH = 128
VARIANTS = {"standard": {}, "bigmac": {"moe_variant": "bigmac", "bigmac_ratio": 0.5}, "farskip": {"farskip": "all"},
            "flat": {"init_method_std": 0.02}}  # near-uniform next-token distributions (sampling tests)
PROMPTS = ["First Citizen:", "Before we proceed any further, hear me speak.", "All:",
           "You are all resolved rather to die than to famish?", "Speak, speak.", "MENENIUS:"]


def _make(root: str) -> None:
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.eval.conftest import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        for name, overrides in VARIANTS.items():
            save_tiny(os.path.join(root, name), dict(overrides, seq_length=SEQ_LENGTH))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def serve_ckpts(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("serve_ckpts"))
    code = f"import sys; sys.path.insert(0, {REPO!r}); from tests.serving.conftest import _make; _make({root!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: os.path.join(root, name) for name in VARIANTS}


def offline_greedy_rank(rank, world_size, ckpt: str, prompts, max_new: int, generation: str = "auto"):
    """evaluate_lm's generation (offline_lm's greedy batch, one prompt at a time; no lm-eval needed):
    [(generated token ids without EOD, text)]."""
    from megatron.training.offline_lm import CheckpointLM, GenJob, GreedyBatch

    lm = CheckpointLM.from_checkpoint(ckpt, generation=generation)
    out = []
    for prompt in prompts:
        tokens = prompt if isinstance(prompt, list) else lm.tok_encode(prompt)
        batch = GreedyBatch(lm, [GenJob(tokens, [], max_new)])
        while not batch.finished:
            batch.step()
        out.append((list(batch.generated[0]), batch.texts()[0]))
    return out, lm.generation.value


def offline_greedy(ckpt: str, prompts, max_new: int, generation: str = "auto"):
    from tools.spawn import run_distributed

    return run_distributed(offline_greedy_rank, 1, ckpt, prompts, max_new, generation, timeout_s=240)[0]


class Server:
    """A server subprocess: ``url``, ``info`` (the ready file), ``proc``. ``frontend_process``:
    ``serve --nproc-per-node`` (the front end in its own process, the ranks under torchrun as its
    child); otherwise torchrun for several ranks, or one process."""

    def __init__(self, ckpt: str, tmp_path, *, nproc: int = 1, extra=(), timeout_s: float = 240,
                 frontend_process: bool = False):
        self.ready = str(tmp_path / f"ready-{time.monotonic_ns()}.json")
        self.log = open(tmp_path / f"server-{time.monotonic_ns()}.log", "w+")
        args = ["-m", "megatron.inference.serve", "--load", ckpt, "--port", "0", "--ready-file", self.ready,
                "--shutdown-timeout", "20", *[str(a) for a in extra]]
        if frontend_process:
            cmd = [sys.executable, *args, "--nproc-per-node", str(nproc)]
        elif nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
        else:
            cmd = [sys.executable, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not start:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        with open(self.ready) as f:
            self.info = json.load(f)
        self.url = self.info["url"]

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def post(url: str, path: str, body, timeout: float = 60):
    """(status, decoded JSON) of a POST; ``body`` bytes are sent as they are."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get_metrics(url: str) -> dict:
    import urllib.request

    from megatron.inference.metrics import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode())


# A DeepSeek-V2-Lite-shaped model, scaled down (examples/bench_farskip_dsv2lite_cpu.yaml's layout:
# MLA without query compression, latent KV with decoupled RoPE heads and latent norms, YaRN, a dense
# first layer, two shared experts, fine-grained routed experts with softmax before top-k), trained
# a few steps by pretrain_gpt at EP=2. Init std 0.3 and a small learning rate keep its next-token
# distributions peaked, so greedy comparisons hinge on real differences, not last-bit rounding.
MLA_ARGS = [
    "--num-layers", 3, "--hidden-size", 64, "--num-attention-heads", 4, "--ffn-hidden-size", 128,
    "--seq-length", 128, "--max-position-embeddings", 128, "--multi-latent-attention", "--kv-lora-rank", 16,
    "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 8, "--qk-layernorm", "--rope-type", "yarn",
    "--rotary-scaling-factor", 4, "--original-max-position-embeddings", 32, "--mscale", 0.707,
    "--mscale-all-dim", 0.707, "--norm-epsilon", 1e-6, "--num-experts", 8, "--moe-router-topk", 3,
    "--moe-ffn-hidden-size", 24, "--moe-shared-expert-intermediate-size", 48, "--moe-layer-freq", "[0,1,1]",
    "--moe-router-pre-softmax", "--transformer-impl", "local", "--init-method-std", 0.3,
    "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 1e-4, "--lr-warmup-iters", 1,
    "--log-interval", 1, "--eval-interval", 100, "--eval-iters", 1, "--split", "949,50,1",
]


@pytest.fixture(scope="session")
def mla_ckpt(tmp_path_factory) -> str:
    from tests.helpers import torchrun

    root = tmp_path_factory.mktemp("mla")
    save = root / "dsv2_tiny"
    proc = torchrun("megatron.training.pretrain_gpt", MLA_ARGS + [
        "--train-iters", 4, "--expert-model-parallel-size", 2, "--save", save, "--save-interval", 4,
        "--data-cache-path", root / "cache"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(save)
