"""Shared helpers for the distributed model tests (tiny configs, batches, one training step)."""

from __future__ import annotations

import torch

from moe_variants.config import ModelConfig, ParallelConfig

VOCAB = 96


def tiny_model_config(**overrides) -> ModelConfig:
    """A 2-layer MoE small enough for multi-process CPU tests (a few ms per step); ``overrides`` are
    flat flag values, the variants' included (``farskip="all"``)."""
    cfg = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=32,
        moe_aux_loss_coeff=0.01,
        transformer_impl="local",
    )
    cfg.update(overrides)
    return ModelConfig.from_flat(cfg)


def batch(index: int, batch_size: int = 2, seq_length: int = 16, vocab: int = VOCAB):
    """Deterministic tokens and labels for data-parallel replica ``index``."""
    gen = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, vocab, (batch_size, seq_length + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_loss(model, tokens, labels):
    """Per-token loss [b, s] of a megatron-core GPTModel (explicit causal mask: see model_builder)."""
    from moe_variants.builder import causal_attention_mask

    seq = tokens.shape[1]
    position_ids = torch.arange(seq)[None].expand_as(tokens)
    return model(tokens, position_ids, causal_attention_mask(seq), labels=labels)


def build_and_load(model_cfg: ModelConfig, parallel: ParallelConfig, state=None, seed: int = 7):
    """Initialise the layout, build the model and (optionally) load a global state dict into it."""
    from moe_variants.global_state import load_global_state_dict
    from moe_variants.builder import build_model
    from megatron.components.parallel import initialize_parallel

    pgc = initialize_parallel(parallel, seed=seed)
    model = build_model(model_cfg, parallel, vocab_size=VOCAB, pg_collection=pgc)
    if state is not None:
        load_global_state_dict(model, state, pgc)
    return model, pgc


def torchrun(module: str, args, nproc: int = 2, timeout: float = 300, env=None, launcher_args=()):
    """Run ``torchrun --nproc_per_node=nproc [launcher_args] -m module args`` from the repo root;
    returns the CompletedProcess (stdout/stderr as text)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--standalone", *launcher_args, "-m", module, *[str(a) for a in args],
    ]
    return subprocess.run(cmd, cwd=repo, env=full_env, capture_output=True, text=True, timeout=timeout)


def start_agent(log_path, module: str, args, *, port: int, nnodes: int = 2, nproc_per_node: int = 1,
                max_restarts: int = 0, env=None):
    """One node's torchrun agent, as ``scripts/launch_multinode.sh`` starts it on every node of a
    cluster (c10d rendezvous on 127.0.0.1:``port``), running ``-m module args``; in a session of its
    own, output to ``log_path``. ``kill_agent`` stops it with its ranks (a lost node)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo, PYTHON=sys.executable, NNODES=str(nnodes),
                    GPUS_PER_NODE=str(nproc_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    MAX_RESTARTS=str(max_restarts))
    full_env.update(env or {})
    with open(log_path, "w") as log:
        return subprocess.Popen(["bash", os.path.join(repo, "scripts", "launch_multinode.sh"), module,
                                 *[str(a) for a in args]], cwd=repo, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill_agent(agent) -> None:
    """SIGKILL a ``start_agent`` agent and every process below it (torchrun starts each rank in a
    session of its own, so the agent's session alone would leave the ranks running)."""
    import os
    import signal

    import psutil

    try:
        below = psutil.Process(agent.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for proc in below:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    agent.wait()


def run_agents(log_dir, module: str, args, *, nnodes: int = 2, timeout: float = 300, **kwargs) -> list:
    """``nnodes`` agents of one job on this machine (``start_agent``), waited for; their exit codes
    (124: killed after ``timeout``). Logs in ``log_dir/agent<i>.log``."""
    import os
    import subprocess
    import time

    from tools.bench.launcher import free_port

    port = free_port()
    agents = [start_agent(os.path.join(log_dir, f"agent{i}.log"), module, args, port=port, nnodes=nnodes, **kwargs)
              for i in range(nnodes)]
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_agent(agent)
            codes.append(124)
    return codes


def read_jsonl(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


SMALL_PRETRAIN_ARGS = [
    "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--ffn-hidden-size", 128,
    "--seq-length", 32, "--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 64,
    "--moe-shared-expert-intermediate-size", 64, "--transformer-impl", "local",
    "--micro-batch-size", 4, "--global-batch-size", 16, "--lr", 3e-3, "--lr-warmup-iters", 2,
    "--log-interval", 1, "--eval-interval", 100, "--eval-iters", 2, "--split", "949,50,1",
]


def write_arc_easy(root, num_questions: int = 5):
    """The shared-data layout of the offline ARC-Easy task (``eval/arc/arc_easy.jsonl``), generated;
    returns ``root``."""
    import json
    from pathlib import Path

    arc = Path(root) / "eval" / "arc"
    arc.mkdir(parents=True, exist_ok=True)
    with open(arc / "arc_easy.jsonl", "w") as f:
        for i in range(num_questions):
            choices = [f"the {w} number {i}" for w in ("first", "second", "third", "fourth")]
            f.write(json.dumps({"query": f"Question: which is number {i}?", "choices": choices, "gold": i % 4}) + "\n")
    return root


def has_cuda() -> bool:
    return torch.cuda.is_available()


def requires_gpu(fn_or_cls=None):
    """``pytest.mark.skipif`` on machines without a CUDA GPU."""
    import pytest

    mark = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
    return mark if fn_or_cls is None else mark(fn_or_cls)
