"""A tiny MoE checkpoint, generated prompts, their profile and a placed copy, shared by the
model-side Sem-MoE tests (built once per session, a few seconds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tools.spawn import run_distributed

# 2 MoE layers x 8 experts, top-2; the embedded 2048-token BPE
MODEL = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=64, num_experts=8,
    moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, transformer_impl="local",
)  # fmt: skip
WORDS = (
    "the king queen castle river stone sword horse night morning bread wine ship sea storm wind "
    "garden rose summer winter letter war peace army council money market price gold silver "
    "doctor fever heart blood bone music song dance poem number seven eleven twelve hundred"
).split()


@dataclass(frozen=True)
class ModelFixture:
    ckpt: str
    prompts: str
    profile_path: str
    tables2: str  # semmoe tables at D = 2 solved on the profile
    placed2: str  # ckpt with tables2 applied


def _save_tiny(rank, world, out):
    from megatron.components.arguments import configs_from_dict
    from megatron.components.loading import save_model
    from moe_variants.builder import build_model
    from megatron.components.parallel import initialize_parallel
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    configs = configs_from_dict(dict(MODEL))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    pgc = initialize_parallel(configs.parallel, seed=5)
    model = build_model(configs.model, configs.parallel, vocab_size=tokenizer.vocab_size, pg_collection=pgc)
    return save_model(out, model, configs, tokenizer_files={"tokenizer_model": DEFAULT_TOKENIZER_MODEL},
                      tokenizer_info={"type": "HuggingFaceTokenizer", "vocab_size": tokenizer.vocab_size})


def write_prompts(path: Path, num: int, seed: int) -> None:
    """Generated prompts: ``num`` lines of 3-40 words from a fixed list (some with digits, so the
    vocabulary has tokens the profile never sees)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(num):
            words = rng.choice(WORDS, size=int(rng.integers(3, 41)))
            f.write(json.dumps({"id": f"g{i}", "text": " ".join(words)}) + "\n")


def _build_profile_apply(rank, world, root):
    """Save the tiny checkpoint, profile the prompts (EP=1), solve Sem-MoE tables for D=2 and apply
    them: one forked rank, so the test process never holds a process group."""
    from tools.semmoe.apply import apply_placement
    from moe_variants.semmoe.methods import place
    from tools.semmoe.model_run import RunOptions, profile_rank
    from moe_variants.semmoe.profile import save_profile
    from moe_variants.semmoe.tables import save_tables

    _save_tiny(rank, world, f"{root}/ckpt")
    profile = profile_rank(RunOptions(load=f"{root}/ckpt", data=f"{root}/prompts.jsonl", batch_tokens=256))
    save_profile(profile, f"{root}/profile.npz")
    save_tables(place("semmoe", profile, 2, seed=0), f"{root}/tables2")
    apply_placement(f"{root}/ckpt", f"{root}/tables2", f"{root}/placed2")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> ModelFixture:
    # megatron-core takes seconds to import: once here, inherited by every forked rank after
    import megatron.core.models.gpt  # noqa: F401
    import megatron.components.loading  # noqa: F401
    import moe_variants.builder  # noqa: F401
    import megatron.components.parallel  # noqa: F401

    root = tmp_path_factory.mktemp("semmoe_model")
    write_prompts(root / "prompts.jsonl", 24, seed=0)
    run_distributed(_build_profile_apply, 1, str(root))
    return ModelFixture(*(str(root / n) for n in ("ckpt", "prompts.jsonl", "profile.npz", "tables2", "placed2")))
