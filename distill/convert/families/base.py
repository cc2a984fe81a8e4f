"""What a model family provides, and the config fields every decoder family shares.

A family maps a Hugging Face ``config.json`` to our ``ModelConfig`` fields (``model_config``), back
(``hf_config``), and lists the tensor ``Rule``s between the two state dicts (``rules``). Settings the
mapping cannot reproduce exactly raise ``ValueError`` naming the HF key (or our flag) instead of
converting to a model that computes something else.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from moe_variants import registry
from moe_variants.config import ModelConfig, moe_layer_pattern

__all__ = ["Family", "get", "refuse", "common_model_fields", "common_hf_fields", "check_exportable",
           "layer_freq", "dense_layers", "optional_int"]

# The sequence length recorded for training a converted model (its rotary tables are built on
# demand, so this does not limit inference); capped so a 128k-context config does not default to
# 128k-token training batches.
MAX_DEFAULT_SEQ_LENGTH = 4096


class Family:
    """One Hugging Face architecture. Subclasses set the class attributes and the three methods."""

    model_type: str = ""
    architecture: str = ""  # the *ForCausalLM class written on export
    config_class: str = ""  # the transformers config class (export writes config.json through it)
    # HF tensors that are not weights of the model (buffers some checkpoints carry)
    ignored_hf: tuple[str, ...] = (r"\.rotary_emb\.inv_freq$",)

    def model_config(self, hf: dict) -> dict:
        """HF config -> ``ModelConfig`` field values."""
        raise NotImplementedError

    def hf_config(self, model: ModelConfig, vocab_size: int) -> dict:
        """``ModelConfig`` -> HF config keys (architecture keys only; the caller adds the rest)."""
        raise NotImplementedError

    def rules(self, model: ModelConfig) -> list:
        """Every tensor ``Rule`` of a model with this config."""
        raise NotImplementedError

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.search(p, hf_name) for p in self.ignored_hf)


def refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(message)


def get(hf: dict, key: str, default: Any = ..., *, family: str = "") -> Any:
    """``hf[key]``; a missing required key is a one-line error naming it."""
    value = hf.get(key, default)
    if value is ...:
        raise ValueError(f"config.json ({family or hf.get('model_type')}) has no {key!r}")
    return value


def layer_freq(pattern: list[int]):
    """Our ``moe_layer_freq``: 1 when every layer is MoE, else the explicit 0/1 list."""
    return 1 if all(pattern) else list(pattern)


def common_model_fields(hf: dict, family: str) -> dict:
    """Fields every supported decoder shares: sizes, RMSNorm, SwiGLU, RoPE, tied embeddings."""
    act = hf.get("hidden_act", "silu")
    refuse(act != "silu", f"config.json ({family}): hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
    refuse(bool(hf.get("attention_bias", False)), f"config.json ({family}): attention_bias true is not supported")
    refuse(bool(hf.get("mlp_bias", False)), f"config.json ({family}): mlp_bias true is not supported")
    heads = int(get(hf, "num_attention_heads", family=family))
    max_pos = int(get(hf, "max_position_embeddings", family=family))
    theta = float(hf.get("rope_theta", 10000.0))
    return dict(
        num_layers=int(get(hf, "num_hidden_layers", family=family)),
        hidden_size=int(get(hf, "hidden_size", family=family)),
        num_attention_heads=heads,
        vocab_size=int(get(hf, "vocab_size", family=family)),
        max_position_embeddings=max_pos,
        seq_length=min(max_pos, MAX_DEFAULT_SEQ_LENGTH),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=int(theta) if theta.is_integer() else theta,
        rotary_percent=1.0,
        untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
    )


def check_exportable(model: ModelConfig, family: str) -> None:
    """Settings with no Hugging Face equivalent in any supported family."""
    for variant in registry.enabled(model):
        reason = variant.export_refusal(model, family)
        refuse(reason is not None, reason)
    refuse(model.normalization != "RMSNorm", f"--normalization {model.normalization}: {family} uses RMSNorm")
    refuse(not model.swiglu, f"{family} needs --swiglu")
    refuse(model.position_embedding_type != "rope", f"{family} needs --position-embedding-type rope")
    refuse(model.rotary_percent != 1.0, f"--rotary-percent {model.rotary_percent}: {family} rotates whole heads")
    refuse(not model.is_moe, f"{family} export needs an MoE model (--num-experts)")
    refuse(model.moe_router_score_function != "softmax",
           f"--moe-router-score-function {model.moe_router_score_function}: {family} routes with softmax")
    refuse(model.moe_router_enable_expert_bias, f"--moe-router-enable-expert-bias has no {family} equivalent")


def common_hf_fields(model: ModelConfig, vocab_size: int) -> dict:
    max_pos = model.max_position_embeddings or model.seq_length
    return dict(
        vocab_size=int(vocab_size),
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=max_pos,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=float(model.rotary_base),
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
        initializer_range=model.init_method_std,
        attention_dropout=model.attention_dropout,
    )


def dense_layers(model: ModelConfig) -> list[int]:
    return [i for i, moe in enumerate(moe_layer_pattern(model)) if not moe]


def optional_int(value) -> Optional[int]:
    return None if value is None else int(value)
