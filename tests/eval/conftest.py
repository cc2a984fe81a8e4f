"""Tiny checkpoints (random weights, saved with ``loading.save_model``) for the lm-eval tests.

The weights are initialised with a large std (0.5) so the next-token distributions are peaked:
greedy choices then do not hinge on last-bit rounding differences between batch shapes.

The checkpoints are written by one plain subprocess (a world of one gloo rank), not by a
``run_distributed`` rank: a checkpoint save starts megatron-core's multiprocessing manager, which
a process that exits normally shuts down, but a forked rank that is killed at the end of
``run_distributed`` would leave behind.
"""

import os
import subprocess
import sys

import pytest

SEQ_LENGTH = 32
VARIANTS = {
    "standard": {},
    "farskip": {"farskip": "all"},
    "farskip-overlapped": {"farskip": "all", "farskip_impl": "overlapped"},
    "bigmac": {"moe_variant": "bigmac", "bigmac_ratio": 0.5},
}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def save_tiny(path: str, overrides: dict) -> None:
    """Build a 2-layer, 4-expert model with the embedded BPE tokenizer and save it (EP=1).
    Needs an initialised torch.distributed world."""
    from megatron.components.arguments import configs_from_dict
    from megatron.components.loading import save_model
    from moe_variants.builder import build_model
    from megatron.components.parallel import initialize_parallel
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ_LENGTH,
                  num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                  moe_shared_expert_intermediate_size=32, transformer_impl="local", init_method_std=0.5)
    values.update(overrides)
    configs = configs_from_dict(values)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    pgc = initialize_parallel(configs.parallel, seed=11)
    model = build_model(configs.model, configs.parallel, vocab_size=tokenizer.vocab_size, pg_collection=pgc)
    save_model(path, model, configs, iteration=1, tokenizer_files={"tokenizer_model": DEFAULT_TOKENIZER_MODEL},
               tokenizer_info={"type": "HuggingFaceTokenizer", "vocab_size": tokenizer.vocab_size})


def _main(root: str) -> None:
    import tempfile

    import torch.distributed as dist

    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        for name, overrides in VARIANTS.items():
            save_tiny(os.path.join(root, name), overrides)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def make_checkpoints(root) -> dict:
    """{variant: checkpoint dir} for a standard MoE, a FarSkip (all layers) and a BigMac model."""
    code = f"import sys; sys.path.insert(0, {REPO!r}); from tests.eval.conftest import _main; _main({str(root)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: os.path.join(str(root), name) for name in VARIANTS}


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return make_checkpoints(tmp_path_factory.mktemp("lm_eval_ckpts"))
