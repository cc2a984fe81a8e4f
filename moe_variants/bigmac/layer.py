"""BigMac's descend-communicate-communicate-ascend MoE layer on megatron-core.

Router on the full hidden state; a shared down-projection ``fc1_latent_proj`` (h -> r*h) before the
dispatch all-to-all; experts reversed to up-then-down inside the low dimension (r*h -> F -> r*h);
the combine all-to-all in r*h; the up-projection ``fc2_latent_proj`` (r*h -> h) after it; shared
experts stay full-dimension. This is megatron-core 0.16.1's "latent MoE" dataflow
(``moe_layer.py:170-193, 265-269, 342-344``) with the same parameter names and shapes, without its
Transformer Engine requirement: the projections are plain duplicated linears, so the layer runs with
the local spec on CPU and with either spec on GPU, with both dispatchers, EP, TP, dropless and
capacity-factor routing. Probabilities weight and sum the top-k expert outputs in the low dimension
before the single up-projection, which equals projecting each because the projection is linear.

With the local experts (grouped GEMMs or the ``SequentialMLP`` loop) the routing probabilities scale
each expert's L-wide output instead of its F-wide intermediate activation (megatron-core's
``per_token_scale``): the same product, since the expert's fc2 is linear, but on a tensor F / L (8x
at r = 0.25) times narrower in the forward and in the two backward products (the activation's
gradient and the probabilities' gradient) -- see docs/design/bigmac.md, "Where the routing probabilities are applied".

Shape legend: T tokens, H hidden, L latent (r*H), F expert intermediate, N routed token copies.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP

from moe_variants.common.experts import RoutedExperts
from moe_variants.common.moe_layer import ProjectMoELayer

__all__ = ["BigMacMoELayer", "DuplicatedLinear", "LatentExperts", "LatentSequentialMLP"]


class DuplicatedLinear(MegatronModule):
    """A linear layer replicated on every tensor-parallel rank (TE's ``parallel_mode="duplicated"``).

    ``forward`` returns ``(output, None)`` like megatron-core's linear layers. Under sequence
    parallelism each TP rank sees a different slice of the sequence, so the weight is tagged for the
    TP gradient all-reduce (as the router's is).
    """

    def __init__(self, input_size: int, output_size: int, config, init_method):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.linear(x, self.weight), None


class LatentSequentialMLP(SequentialMLP):
    """megatron-core's ``SequentialMLP`` whose routing probabilities scale the expert output.

    Upstream multiplies the probabilities into the activation ``[N, F]`` before fc2
    (``mlp.py`` ``per_token_scale``), which suits a fine-grained expert (F < H). A reversed expert has
    F = 4-8 x L, so scaling its output ``[N, L]`` is the cheaper place for the same product
    ``fc2(p * a) = p * fc2(a)`` (fc2 is linear; a bias is added before scaling, as upstream scales it).
    Parameters, names and state dicts are ``SequentialMLP``'s. fp8/fp4 padding and
    ``moe_apply_probs_on_input`` keep the upstream path.
    """

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        config = self.config
        if config.moe_apply_probs_on_input or config.fp8 or config.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.num_local_experts == 1:
            chunks = [permuted_local_hidden_states]
        else:
            chunks = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        outputs = []
        for expert, tokens in zip(self.local_experts, chunks):
            output, output_bias = expert(tokens)
            if output_bias is not None:
                output = output + output_bias
            outputs.append(output)
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)  # [N, L]
        return (output * permuted_probs.unsqueeze(-1)).to(output.dtype), None


class LatentExperts:
    """Spec factory: the configured expert module, built with BigMac's latent input/output size.

    ``build_module`` passes ``(num_local_experts, config, submodules=, pg_collection=)``; this
    returns the real expert class built on a copy of the config whose ``moe_latent_size`` and
    ``moe_ffn_hidden_size`` are BigMac's (megatron-core's ``MLP`` sizes expert fc1-in/fc2-out from
    ``moe_latent_size``, ``mlp.py:117-153``). The probabilities scale the expert output:
    ``SequentialMLP`` becomes ``LatentSequentialMLP``, and the project's ``RoutedExperts`` builds
    ``GroupedExperts`` with ``probs_on_output`` (or ``LatentSequentialMLP`` where the grouped
    kernel refuses the latent widths). ``expert_params`` are the expert spec's own params.
    """

    def __new__(cls, num_local_experts, config, submodules=None, pg_collection=None, *,
                expert_module, latent_size: int, ffn_hidden_size: int, **expert_params):
        latent_config = copy.deepcopy(config)
        latent_config.moe_latent_size = latent_size
        latent_config.moe_ffn_hidden_size = ffn_hidden_size
        if expert_module is SequentialMLP:
            expert_module = LatentSequentialMLP
        elif expert_module is RoutedExperts:
            expert_params = {**expert_params, "probs_on_output": True, "loop_module": LatentSequentialMLP}
        return expert_module(num_local_experts, latent_config, submodules, pg_collection=pg_collection,
                             **expert_params)


class BigMacMoELayer(ProjectMoELayer):
    """megatron-core ``MoELayer`` with BigMac's DCCA dataflow (see the module docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *,
                 latent_size: int, expert_ffn_hidden_size: int, up_init_scaled: bool = True):
        from megatron.core.transformer.spec_utils import ModuleSpec

        experts = submodules.experts
        expert_spec = experts if isinstance(experts, ModuleSpec) else ModuleSpec(module=experts)
        submodules = copy.copy(submodules)
        submodules.experts = ModuleSpec(
            module=LatentExperts,
            params={"expert_module": expert_spec.module, "latent_size": latent_size,
                    "ffn_hidden_size": expert_ffn_hidden_size, **expert_spec.params},
            submodules=expert_spec.submodules,
        )
        super().__init__(config, submodules, layer_number, pg_collection)
        self.latent_size = latent_size
        self.fc1_latent_proj = DuplicatedLinear(config.hidden_size, latent_size, config, config.init_method)
        up_init = config.output_layer_init_method if up_init_scaled else config.init_method
        self.fc2_latent_proj = DuplicatedLinear(latent_size, config.hidden_size, config, up_init)

    def preprocess(self, hidden_states, probs, routing_map):
        """Down-project [T, H] -> [T, L], then the dispatcher's permutation (in L)."""
        hidden_states, _ = self.fc1_latent_proj(hidden_states)
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def postprocess(self, output, shared_expert_output):
        """Unpermute and sum the top-k outputs in L, up-project [T, L] -> [T, H], add shared."""
        output = self.token_dispatcher.combine_postprocess(output)
        output, _ = self.fc2_latent_proj(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

