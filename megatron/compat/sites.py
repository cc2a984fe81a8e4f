"""The upstream megatron-core 0.16.1 source each adaptation works around.

Every pin is a ``Site(path, function, text)``: ``text`` occurs on a line of ``function`` in
``path`` (relative to megatron/core). ``function`` is the dotted name of the enclosing class or
function (``Class.method``, ``function.inner``), or ``MODULE`` for the module's own statements
outside any class or function; ``site_problem`` finds it by parsing the file with ``ast``. Pins are
anchored on text and function, not line numbers, so an upgrade that only moves code reports
nothing, while one that changes the text or moves it to another function reports that site.
``tests/compat/test_staleness.py`` checks every module-level ``*_SITES`` list of this package
against the installed wheel: a failure after a megatron-core upgrade is the signal to re-check
(and likely delete) the adaptation.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Optional

CHECKED_VERSION = "0.16.1"

MODULE = "<module>"


@dataclasses.dataclass(frozen=True)
class Site:
    """``text`` on a line of ``function`` (a dotted class/function name, or ``MODULE``) in
    megatron/core/``path``."""

    path: str
    function: str
    text: str

    def __str__(self) -> str:
        return f"megatron/core/{self.path} {self.function}: {self.text!r}"


@functools.lru_cache(maxsize=32)
def _spans(source: str) -> dict[str, list[tuple[int, int]]]:
    """Each class's and function's dotted name in ``source`` -> its (first, last) lines, decorators
    included (a name defined in two branches of an ``if``/``try`` has two spans)."""
    spans: dict[str, list[tuple[int, int]]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                spans.setdefault(name, []).append((first, child.end_lineno))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return spans


def _scope_lines(spans: dict[str, list[tuple[int, int]]], function: str, num_lines: int) -> list[int]:
    """The 1-based lines of ``function`` (for ``MODULE``: the lines outside every top-level class
    and function)."""
    if function != MODULE:
        return [line for first, last in spans.get(function, []) for line in range(first, last + 1)]
    inside = {line for name, ranges in spans.items() if "." not in name
              for first, last in ranges for line in range(first, last + 1)}
    return [line for line in range(1, num_lines + 1) if line not in inside]


def enclosing(source: str, line: int) -> str:
    """The dotted name of the innermost class or function around ``line`` of ``source``, or
    ``MODULE``."""
    spans = _spans(source)
    around = [(last - first, name) for name, ranges in spans.items()
              for first, last in ranges if first <= line <= last]
    return min(around)[1] if around else MODULE


def site_problem(site: Site, source: str) -> Optional[str]:
    """Why ``site`` no longer holds in ``source`` (its upstream file's text), or None if it does."""
    lines = source.splitlines()
    spans = _spans(source)
    if site.function != MODULE and site.function not in spans:
        return f"{site}: {site.function} is no longer defined in the file"
    if any(site.text in lines[line - 1] for line in _scope_lines(spans, site.function, len(lines))):
        return None
    elsewhere = [line for line, text in enumerate(lines, 1) if site.text in text]
    where = (f"; it is now at line {elsewhere[0]}, in {enclosing(source, elsewhere[0])}" if elsewhere
             else ", nor anywhere else in the file")
    return f"{site}: no longer in {site.function}{where}"


# The CPU device redirect (cpu_device.py): CUDA allocations, streams and type-string checks on
# the code paths our CPU runs exercise.
CPU_DEVICE_SITES = [
    Site("pipeline_parallel/schedules.py", "forward_backward_no_pipelining",
         'torch.zeros([], dtype=torch.int, device="cuda")'),
    Site("pipeline_parallel/schedules.py", "forward_backward_pipelining_with_interleaving",
         'torch.zeros([], dtype=torch.int, device="cuda")'),
    Site("pipeline_parallel/schedules.py", "forward_backward_pipelining_without_interleaving",
         'torch.zeros([], dtype=torch.int, device="cuda")'),
    Site("distributed/param_and_grad_buffer.py", "_ParamAndGradBuffer.__init__", 'torch.zeros([1], device="cuda")'),
    Site("distributed/param_and_grad_buffer.py", "_ParamAndGradBuffer.__init__", "device=torch.cuda.current_device()"),
    Site("optimizer/optimizer.py", "MixedPrecisionOptimizer.__init__", "device='cuda'"),
    Site("optimizer/optimizer.py", "Float16OptimizerWithFloat16Params.__init__",
         "param.type() == 'torch.cuda.FloatTensor'"),
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer._build_model_and_main_param_groups",
         "model_param.type() == 'torch.cuda.FloatTensor'"),
    Site("optimizer/clip_grads.py", "get_grad_norm_fp32", "device='cuda'"),
    Site("optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32",
         "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    Site("optimizer/clip_grads.py", "count_zeros_fp32", "device='cuda'"),
    Site("tensor_parallel/mappings.py", "_gather_along_last_dim", "device=torch.cuda.current_device()"),
    Site("tensor_parallel/mappings.py", "_gather_along_first_dim", "device=torch.cuda.current_device()"),
    Site("tensor_parallel/mappings.py", "_reduce_scatter_along_first_dim", "device=torch.cuda.current_device()"),
    Site("tensor_parallel/mappings.py", "_AllToAll.forward", "device=torch.cuda.current_device()"),
    Site("tensor_parallel/layers.py", "LinearWithGradAccumulationAndAsyncCommunication.backward",
         "device=torch.cuda.current_device()"),
    Site("utils.py", "GlobalMemoryBuffer.get_tensor", "device=torch.cuda.current_device()"),
    Site("models/common/embeddings/rotary_pos_embedding.py", "RotaryEmbedding.get_emb", "torch.cuda.current_device()"),
    Site("transformer/utils.py", "get_default_causal_mask", 'device="cuda"'),
    Site("transformer/moe/moe_utils.py", "track_moe_metrics", 'device="cuda"'),
    Site("transformer/moe/router.py", "Router.gating", "device=torch.cuda.current_device()"),
    Site("transformer/moe/token_dispatcher.py", "MoEAlltoAllTokenDispatcher.__init__", "torch.cuda.Stream()"),
]

# The import hook in __init__.py: jit.py sets jit_fuser = torch.compile when it runs, fusion modules
# then decorate with it at their import, and its own disable_jit_fuser() makes it a no-op.
JIT_FUSER_SITES = [
    Site("jit.py", "enable_jit_fuser", "jit_fuser = torch.compile"),
    Site("jit.py", "disable_jit_fuser", "jit_fuser = noop_decorator"),
    Site("jit.py", MODULE, "enable_jit_fuser()"),
    Site("fusions/fused_bias_geglu.py", MODULE, "from megatron.core.jit import jit_fuser"),
]

# te_general_gemm: imported only inside the `try: import transformer_engine` block, but used
# unconditionally by router_gating_linear, so every run without TE (CPU or GPU) hits a NameError.
TE_GENERAL_GEMM_SITES = [
    Site("transformer/moe/moe_utils.py", MODULE, "te_general_gemm,"),
    Site("transformer/moe/moe_utils.py", "RouterGatingLinearFunction.forward", "if te_general_gemm is not None"),
]

# DistributedOptimizer.state_dict asserts every torch-Adam state has one common `step`, which a
# fresh optimizer lacks when loading (prepare_optimizer_for_load); the fully reshardable loader
# leaves `step` out of the tensors it hands _set_main_param_and_optimizer_states, which copies every
# key of the state; load_state_dict gives every state the same `step` tensor
# (_fix_distributed_optimizer_step).
DIST_OPT_LOAD_SITES = [
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer._set_main_param_and_optimizer_states",
         "dst_tensors[key].copy_(tensors[key])"),
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer.load_parameter_state_from_fully_reshardable",
         'if k == "step":'),
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer.load_state_dict", 's["step"] = step'),
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer.state_dict", "assert len(steps) == 1"),
    Site("optimizer/distrib_optimizer.py", "DistributedOptimizer._init_optimizer_states_with_dummy_values",
         "def _init_optimizer_states_with_dummy_values(self):"),
]

# Upstream code the project's own subclasses copy, override or work around outside this package.
# A change at any of these sites means the copy or override must be re-checked against upstream.
UPSTREAM_COUPLING_SITES = [
    # compat/token_dispatcher.py overrides this private method (host split sizes on CPU) and gives it
    # a public name for moe_variants/common/dispatcher.py, which replaces the steps that call it
    Site("transformer/moe/token_dispatcher.py", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
         "def _maybe_dtoh_and_synchronize("),
    Site("transformer/moe/token_dispatcher.py", "MoEAlltoAllTokenDispatcher.token_dispatch",
         "self.tokens_per_expert = self._maybe_dtoh_and_synchronize("),
    # compat/transformer_layer.py wraps the layer's private MLP step (Sem-MoE's Algorithm 3 gathers
    # its output, moe_variants/semmoe/attention_tp.py)
    Site("transformer/transformer_layer.py", "TransformerLayer.forward", "output = self._forward_mlp("),
    Site("transformer/transformer_layer.py", "TransformerLayer._forward_mlp",
         "def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):"),
    Site("transformer/transformer_layer.py", "MoETransformerLayer._forward_mlp",
         "def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):"),
    # moe_variants/farskip/block.py copies TransformerBlock.forward (tests/farskip/test_block_copy.py
    # checks it is bit-identical to upstream with no FarSkip layer)
    Site("transformer/transformer_block.py", "TransformerBlock.forward", "def forward("),
    Site("transformer/transformer_block.py", "TransformerBlock.forward", "hidden_states, context = layer("),
    # moe_variants/farskip/attention.py splits Attention.forward's training path into stages
    Site("transformer/attention.py", "Attention.forward", "def forward("),
    Site("transformer/attention.py", "Attention.forward", "qkv_output = self.get_query_key_value_tensors("),
    Site("transformer/attention.py", "Attention.forward", "query = apply_rotary_pos_emb("),
    Site("transformer/attention.py", "Attention.forward", "key = apply_rotary_pos_emb("),
    Site("transformer/attention.py", "Attention.forward", "output, bias = self.linear_proj(core_attn_out)"),
    # megatron/training/data.py swaps BlendedDataset for a subclass that skips the cache in a single
    # process: upstream calls torch.distributed.get_rank() on a cache miss
    Site("datasets/blended_dataset.py", "BlendedDataset._build_indices", "torch.distributed.get_rank() == 0"),
    Site("datasets/blended_megatron_dataset_builder.py", "BlendedMegatronDatasetBuilder.build_generic_dataset",
         "def build_generic_dataset("),
    # FarSkip's asynchronous TP reduction (moe_variants/common/tp.py) takes the projection's partial
    # sum through RowParallelLinear's own switch for self-reducing (expert) layers
    Site("tensor_parallel/layers.py", "RowParallelLinear.forward", "if self.explicit_expert_comm:"),
    # the backward reordering (moe_variants/common/comm.py) uses this upstream helper
    Site("transformer/moe/shared_experts.py", "set_tensor_grad_fn_sequence_sr",
         "def set_tensor_grad_fn_sequence_sr(tensor, value):"),
]

# Private torch APIs: megatron/compat/autograd.py wraps the first two; the third is what
# megatron-core's set_tensor_grad_fn_sequence_sr calls on a tensor's autograd node ("<grad_fn>");
# megatron/compat/sdpa.py asks the last which attention kernel a call would run.
TORCH_PRIVATE_APIS = [
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "<grad_fn>._set_sequence_nr",
    "torch._fused_sdp_choice",
]

# compat/inference.sampling_controller_class overrides two private steps of the dynamic controller
# (public hooks for the server's ServingController, megatron/inference/engine.py, which turns
# materialize_only_last_token_logits off for the steps that score a prompt (read per forward by
# GPTModel), samples the tokens written into _sampled_tokens_cuda, and maps each request's logits
# rows to prompt positions through request_kv_length_offsets); RankEngine cancels an active request
# through the engine's stop-word early termination.
_CONTROLLER = "inference/text_generation_controllers/text_generation_controller.py"
SERVING_SITES = [
    Site(_CONTROLLER, "TextGenerationController._init_dynamic_sampling_tensors",
         "self._sampled_tokens_cuda = torch.empty(max_requests, dtype=torch.int64, device=device)"),
    Site(_CONTROLLER, "TextGenerationController._dynamic_step_context_init", "def _dynamic_step_context_init("),
    Site(_CONTROLLER, "TextGenerationController._dynamic_step_sample_logits",
         "def _dynamic_step_sample_logits(self, logits: Tensor):"),
    Site(_CONTROLLER, "TextGenerationController.async_generate_output_tokens_dynamic_batch",
         "self._dynamic_step_sample_logits(logits)"),
    Site("models/gpt/gpt_model.py", "GPTModel._postprocess",
         "if in_inference_mode and inference_context.materialize_only_last_token_logits:"),
    Site("inference/contexts/dynamic_context.py", "DynamicInferenceContext.allocate_all_tensors",
         "self.request_kv_length_offsets = torch.empty_like(self.request_ids)"),
    Site("inference/contexts/dynamic_context.py", "DynamicInferenceContext.last_token_logits",
         "def last_token_logits(self, logits: Tensor) -> Tensor:"),
    Site("inference/engines/dynamic_engine.py", "DynamicInferenceEngine._get_and_clear_stop_word_finished_ids",
         "result = self.stop_word_finished_request_ids & set(active_request_ids)"),
]
# tp_collectives.GroupCollectives wraps the entry points megatron-core's TP mappings reduce and gather
# through (counting a served step's TP collectives: megatron.inference.observability.SpanRecorder).
TP_COLLECTIVE_SITES = [
    Site("tensor_parallel/mappings.py", MODULE, "dist_all_gather_func = torch.distributed.all_gather_into_tensor"),
    Site("tensor_parallel/mappings.py", MODULE, "dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor"),
    Site("tensor_parallel/mappings.py", "_reduce", "torch.distributed.all_reduce(input_.contiguous(), group=group)"),
    Site("tensor_parallel/mappings.py", "_gather_along_last_dim",
         "dist_all_gather_func(output, input_.contiguous(), group=group)"),
]
# CpuEvent.elapsed_time (cpu_device.py): the engines time their steps with CUDA events.
CPU_EVENT_SITES = [
    Site(_CONTROLLER, "TextGenerationController.generate_all_output_tokens_static_batch",
         "timing_events[i].elapsed_time(timing_events[i + 1]) / 1e3"),
]

# moe_variants/builder.py `fusions`: which fused kernels exist, as megatron-core resolved them at
# import, and the upstream rules that keep some fusions off (see the comments there).
FUSION_SITES = [
    Site("models/common/embeddings/rope_utils.py", MODULE, "fused_apply_rotary_pos_emb = None"),
    Site("transformer/moe/moe_utils.py", MODULE, "fused_permute,"),
    Site("transformer/moe/moe_utils.py", MODULE, "fused_topk_with_score_function,"),
    # the fused top-k skips router_replay (read by the unfused path's compute_topk)
    Site("transformer/moe/moe_utils.py", "topk_routing_with_score_function", "if fused:"),
    Site("tensor_parallel/layers.py", MODULE, "_grad_accum_fusion_available = False"),
    Site("transformer/transformer_config.py", "TransformerConfig.__post_init__", "self.activation_func == F.gelu"),
    Site("transformer/transformer_config.py", "MLATransformerConfig.__post_init__",
         'if self.multi_latent_attention and self.apply_rope_fusion and self.rope_type != "yarn":'),
]

# moe_variants/common/wgrad.py: why the deferral is off with --overlap-grad-reduce (DDP's backward
# hook asserts a gradient and launches a bucket once all its parameters fired), and why
# megatron-core's own delay_wgrad_compute (Transformer Engine grouped GEMM) is not used for it:
# upstream allows it only with overlap_moe_expert_parallel_comm (its combined 1F1B schedule).
WGRAD_SITES = [
    Site("distributed/distributed_data_parallel.py", "DistributedDataParallel._make_backward_post_hook.hook",
         "param.grad is not None"),
    Site("distributed/distributed_data_parallel.py", "DistributedDataParallel._make_backward_post_hook.hook",
         "self.param_to_bucket_group[param].register_grad_ready("),
    Site("distributed/param_and_grad_buffer.py", "_ParamAndGradBucketGroup.finish_grad_sync",
         "assert self.grad_reduce_handle is not None, ("),
    Site("transformer/transformer_config.py", "TransformerConfig.__post_init__",
         "'overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute'"),
]

# The in-process checkpoint writer (dist_ckpt.py): the Manager-owned results queue read through a
# module global, the per-save writer processes, and the shape of the save function it rebinds.
DIST_CKPT_WRITER_SITES = [
    Site("dist_checkpointing/strategies/filesystem_async.py", MODULE, "_results_queue = None"),
    Site("dist_checkpointing/strategies/filesystem_async.py", "_get_write_results_queue",
         "_results_queue = ctx.Manager().Queue()"),
    Site("dist_checkpointing/strategies/filesystem_async.py", "FileSystemWriterAsync.prepare_write_data",
         "self.results_queue = _get_write_results_queue()"),
    Site("dist_checkpointing/strategies/filesystem_async.py", "FileSystemWriterAsync.get_save_function_and_args",
         "partial(self.write_preloaded_data_multiproc, transform_list, self.use_msc),"),
    Site("dist_checkpointing/strategies/filesystem_async.py", "FileSystemWriterAsync.write_preloaded_data_multiproc",
         'ctx = mp.get_context("fork")'),
    # the writer called through __wrapped__ in a thread (no process-wide gc.disable); CPU tensors
    # are not copied when planned, so checkpointing's async save copies them itself
    Site("dist_checkpointing/strategies/filesystem_async.py", "FileSystemWriterAsync.write_preloaded_data",
         "@_disable_gc()"),
    Site("dist_checkpointing/strategies/filesystem_async.py",
         "FileSystemWriterAsync.prepare_write_data._clone_if_needed", "return ten.clone() if is_view else ten"),
    # SaveFinalize: the two finalize functions it replaces (rank 0 writes, then a broadcast or a
    # barrier the other ranks wait in), the request it replaces them in, and where save appends
    Site("dist_checkpointing/strategies/state_dict_saver.py", "save_state_dict_async_finalize",
         "storage_writer.finish(global_metadata, all_results)"),
    Site("dist_checkpointing/strategies/state_dict_saver.py", "save_state_dict_async_finalize",
         "torch.distributed.broadcast("),
    Site("dist_checkpointing/serialization.py", "save.metadata_finalize_fn", "save_config("),
    Site("dist_checkpointing/serialization.py", "save.metadata_finalize_fn", "torch.distributed.barrier()"),
    Site("dist_checkpointing/serialization.py", "save", "async_request.finalize_fns.append(metadata_finalize_fn)"),
    Site("dist_checkpointing/strategies/torch.py", "TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks",
         "return AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)"),
]
