"""Tiny random Hugging Face models built with transformers' own classes (nothing is downloaded),
the reference forward and greedy decoding, and ours through a converted checkpoint.

Weights are drawn with a large ``initializer_range`` so next-token distributions are peaked:
greedy choices then hinge on real differences, not last-bit rounding.
"""

from __future__ import annotations

import json
import os

import torch

VOCAB = 256
PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 8], [1, 2, 3, 4, 200, 100, 60, 30]])
NEW_TOKENS = 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.25, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (transformers config class, model class, config kwargs)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, num_key_value_heads=2, head_dim=24, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0], rope_theta=10000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        COMMON, num_key_value_heads=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        rope_theta=1e6)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=4, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False, rope_theta=10000.0)),
}

# DeepSeek-V2-Lite's routing and attention variants: no q compression, greedy routing, YaRN
DEEPSEEK_LITE_YARN = dict(
    q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                      mscale=0.707, mscale_all_dim=0.707),
)


def write_tokenizer(directory: str) -> None:
    """A word-level tokenizer.json over VOCAB ids (with an EOS) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<pad>"}, f)


def make_hf_model(directory: str, family: str, seed: int = 0, tokenizer: bool = True, **overrides) -> str:
    """A random tiny model of ``family`` saved with ``save_pretrained`` (safetensors) into ``directory``."""
    import transformers

    config_cls, model_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        write_tokenizer(directory)
    return directory


def load_hf_model(directory: str, family: str, yarn_softmax_fix: bool = False):
    """The HF model in fp32 with eager attention.

    ``yarn_softmax_fix``: multiply DeepSeek-V2's attention scale by mscale(factor, mscale_all_dim)^2,
    as DeepSeek's modeling code and megatron-core do; transformers 4.57 omits it (fixed upstream in
    huggingface/transformers#47435).
    """
    import transformers

    _, model_cls, _ = FAMILIES[family]
    model = getattr(transformers, model_cls).from_pretrained(directory, torch_dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    if yarn_softmax_fix:
        from megatron.core.models.common.embeddings import _yarn_get_mscale

        rope = model.config.rope_scaling
        factor = _yarn_get_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        for layer in model.model.layers:
            layer.self_attn.scaling *= factor
    return model


def greedy(logits_fn, prompt: torch.Tensor, steps: int = NEW_TOKENS):
    """(full-sequence logits of the prompt [B, S, V], greedy continuation [B, steps]); every step
    recomputes the whole sequence (no cache), the same procedure on both sides."""
    first = logits_fn(prompt)
    tokens = prompt
    for _ in range(steps):
        logits = first if tokens is prompt else logits_fn(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return first, tokens[:, prompt.shape[1]:]


def hf_reference(directory: str, family: str, **load_kwargs):
    model = load_hf_model(directory, family, **load_kwargs)
    with torch.no_grad():
        return greedy(lambda t: model(t).logits.float(), PROMPT)


def our_greedy_rank(rank, world_size, ckpt: str, tp: int, ep: int):
    """Run on each rank (run_distributed): load the checkpoint at TP x EP and decode greedily."""
    from moe_variants.config import ParallelConfig
    from megatron.components.loading import load_model
    from moe_variants.builder import causal_attention_mask
    from megatron.components.parallel import device, initialize_parallel

    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, _, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)

    def logits_fn(tokens):  # host tokens in, host logits out; the model runs on this rank's device
        num_s = tokens.shape[1]
        pad = (-num_s) % tp  # sequence parallelism splits the sequence; padding is after, masked
        tokens = torch.cat([tokens, tokens.new_zeros((tokens.shape[0], pad))], 1).to(device())
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        mask = causal_attention_mask(tokens.shape[1], device=tokens.device)
        with torch.no_grad():
            out = model(tokens, positions, mask, runtime_gather_output=True)
        return out[:, :num_s, :VOCAB].float().cpu()

    return greedy(logits_fn, PROMPT)




def cli_rank(rank, world_size, argv_list):
    """Several ``python -m distill.convert`` runs in one one-rank process group:
    [(exit code, stderr text)] per argv."""
    import contextlib
    import io

    from distill.convert.__main__ import main

    results = []
    for argv in argv_list:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as e:  # argparse errors
                code = e.code
        results.append((code, err.getvalue()))
    return results


def parity_rank(rank, world_size, ckpt: str, layouts):
    """Our logits and greedy tokens at each (TP, EP) layout, on the same ranks one after another."""
    return [our_greedy_rank(rank, world_size, ckpt, tp, ep) for tp, ep in layouts]


def stage_state_rank(rank, world_size, ckpt: str, pp: int):
    """This pipeline stage's parameters after loading at PP=``pp``, keyed by global layer index."""
    import re

    from megatron.core import parallel_state
    from moe_variants.config import ParallelConfig
    from moe_variants.global_state import gather_global_state_dict
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel

    parallel = ParallelConfig(pipeline_model_parallel_size=pp)
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, _, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    offset = parallel_state.get_pipeline_model_parallel_rank() * configs.model.num_layers // pp
    return {re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", k): v
            for k, v in gather_global_state_dict(model, pgc).items()}


def native_checkpoint_rank(rank, world_size, ckpt: str, values: dict):
    """Save a randomly initialised model of ours (never imported from HF) and return its logits."""
    from megatron.components.arguments import configs_from_dict
    from megatron.components.loading import save_model
    from moe_variants.builder import build_model, causal_attention_mask
    from megatron.components.parallel import initialize_parallel

    configs = configs_from_dict(values)
    pgc = initialize_parallel(configs.parallel, seed=123)
    model = build_model(configs.model, configs.parallel, vocab_size=VOCAB, pg_collection=pgc).eval()
    save_model(ckpt, model, configs, tokenizer_info={"type": "NullTokenizer", "vocab_size": VOCAB})
    positions = torch.arange(PROMPT.shape[1])[None].expand_as(PROMPT)
    with torch.no_grad():
        logits = model(PROMPT, positions, causal_attention_mask(PROMPT.shape[1]))
    return logits[..., :VOCAB].float()
