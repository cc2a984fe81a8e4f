"""The upstream megatron-core 0.16.1 source lines each adaptation works around.

Every entry is ``(path relative to megatron/core, 1-based line, text expected on that line)``.
``tests/compat/test_staleness.py`` reads the installed wheel and fails, naming the site, when a
line no longer matches: after a megatron-core upgrade that is the signal to re-check (and likely
delete) the adaptation.
"""

CHECKED_VERSION = "0.16.1"

# The CPU device redirect (cpu_device.py): CUDA allocations, streams and type-string checks on
# the code paths our CPU runs exercise.
CPU_DEVICE_SITES = [
    ("pipeline_parallel/schedules.py", 596, 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("pipeline_parallel/schedules.py", 983, 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("pipeline_parallel/schedules.py", 2138, 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("distributed/param_and_grad_buffer.py", 768, 'torch.zeros([1], device="cuda")'),
    ("distributed/param_and_grad_buffer.py", 783, "device=torch.cuda.current_device()"),
    ("optimizer/optimizer.py", 473, "device='cuda'"),
    ("optimizer/optimizer.py", 690, "param.type() == 'torch.cuda.FloatTensor'"),
    ("optimizer/distrib_optimizer.py", 420, "model_param.type() == 'torch.cuda.FloatTensor'"),
    ("optimizer/clip_grads.py", 103, "device='cuda'"),
    ("optimizer/clip_grads.py", 167, "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
    ("optimizer/clip_grads.py", 207, "device='cuda'"),
    ("tensor_parallel/mappings.py", 91, "device=torch.cuda.current_device()"),
    ("tensor_parallel/mappings.py", 141, "device=torch.cuda.current_device()"),
    ("tensor_parallel/mappings.py", 181, "device=torch.cuda.current_device()"),
    ("tensor_parallel/mappings.py", 442, "device=torch.cuda.current_device()"),
    ("tensor_parallel/layers.py", 552, "device=torch.cuda.current_device()"),
    ("utils.py", 631, "device=torch.cuda.current_device()"),
    ("models/common/embeddings/rotary_pos_embedding.py", 162, "torch.cuda.current_device()"),
    ("transformer/utils.py", 35, 'device="cuda"'),
    ("transformer/moe/moe_utils.py", 998, 'device="cuda"'),
    ("transformer/moe/router.py", 90, "device=torch.cuda.current_device()"),
    ("transformer/moe/token_dispatcher.py", 445, "torch.cuda.Stream()"),
]

# te_general_gemm: imported only inside the `try: import transformer_engine` block, but used
# unconditionally by router_gating_linear, so every run without TE (CPU or GPU) hits a NameError.
TE_GENERAL_GEMM_SITES = [
    ("transformer/moe/moe_utils.py", 34, "te_general_gemm,"),
    ("transformer/moe/moe_utils.py", 1192, "if te_general_gemm is not None"),
]

# DistributedOptimizer.state_dict asserts every torch-Adam state has one common `step`, which a
# fresh optimizer lacks when loading (prepare_optimizer_for_load).
DIST_OPT_LOAD_SITES = [
    ("optimizer/distrib_optimizer.py", 642, "assert len(steps) == 1"),
    ("optimizer/distrib_optimizer.py", 1137, "def _init_optimizer_states_with_dummy_values(self):"),
]

# Upstream code the project's own subclasses copy, override or work around outside this package.
# A change at any of these lines means the copy or override must be re-checked against upstream.
UPSTREAM_COUPLING_SITES = [
    # compat/token_dispatcher.py overrides this private method (host split sizes on CPU) and gives it
    # a public name for moe_variants/common/dispatcher.py, which replaces the steps that call it
    ("transformer/moe/token_dispatcher.py", 862, "def _maybe_dtoh_and_synchronize("),
    ("transformer/moe/token_dispatcher.py", 663, "self.tokens_per_expert = self._maybe_dtoh_and_synchronize("),
    # compat/transformer_layer.py wraps the layer's private MLP step (Sem-MoE's Algorithm 3 gathers
    # its output, moe_variants/semmoe/attention_tp.py)
    ("transformer/transformer_layer.py", 514, "output = self._forward_mlp("),
    ("transformer/transformer_layer.py", 683,
     "def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):"),
    ("transformer/transformer_layer.py", 1334,
     "def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):"),
    # moe_variants/farskip/block.py copies TransformerBlock.forward (tests/farskip/test_block_copy.py
    # checks it is bit-identical to upstream with no FarSkip layer)
    ("transformer/transformer_block.py", 621, "def forward("),
    ("transformer/transformer_block.py", 765, "hidden_states, context = layer("),
    # moe_variants/farskip/attention.py splits Attention.forward's training path into stages
    ("transformer/attention.py", 875, "def forward("),
    ("transformer/attention.py", 981, "qkv_output = self.get_query_key_value_tensors("),
    ("transformer/attention.py", 1097, "query = apply_rotary_pos_emb("),
    ("transformer/attention.py", 1110, "key = apply_rotary_pos_emb("),
    ("transformer/attention.py", 1208, "output, bias = self.linear_proj(core_attn_out)"),
    # megatron/training/data.py swaps BlendedDataset for a subclass that skips the cache in a single
    # process: upstream calls torch.distributed.get_rank() on a cache miss
    ("datasets/blended_dataset.py", 153, "torch.distributed.get_rank() == 0"),
    ("datasets/blended_megatron_dataset_builder.py", 491, "def build_generic_dataset("),
    # FarSkip's asynchronous TP reduction (moe_variants/common/tp.py) takes the projection's partial
    # sum through RowParallelLinear's own switch for self-reducing (expert) layers
    ("tensor_parallel/layers.py", 1286, "if self.explicit_expert_comm:"),
    # the backward reordering (moe_variants/common/comm.py) uses this upstream helper
    ("transformer/moe/shared_experts.py", 281, "def set_tensor_grad_fn_sequence_sr(tensor, value):"),
]

# Private torch APIs: megatron/compat/autograd.py wraps the first two; the last is what
# megatron-core's set_tensor_grad_fn_sequence_sr calls on a tensor's autograd node ("<grad_fn>").
TORCH_PRIVATE_APIS = [
    "torch._C._current_graph_task_id",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "<grad_fn>._set_sequence_nr",
]

# megatron-core's dynamic inference engine on CPU / without flash-attn (compat/inference.py).
from megatron.compat.inference import INFERENCE_SITES  # noqa: E402,F401 (re-exported for the staleness test)

# compat/inference.sampling_controller_class overrides two private steps of the dynamic controller
# (public hooks for the server's ServingController, megatron/inference/engine.py, which turns
# materialize_only_last_token_logits off for the steps that score a prompt (read per forward by
# GPTModel), samples the tokens written into _sampled_tokens_cuda, and maps each request's logits
# rows to prompt positions through request_kv_length_offsets); RankEngine cancels an active request
# through the engine's stop-word early termination.
SERVING_SITES = [
    ("inference/text_generation_controllers/text_generation_controller.py", 106,
     "self._sampled_tokens_cuda = torch.empty(max_requests, dtype=torch.int64, device=device)"),
    ("inference/text_generation_controllers/text_generation_controller.py", 491, "def _dynamic_step_context_init("),
    ("inference/text_generation_controllers/text_generation_controller.py", 631,
     "def _dynamic_step_sample_logits(self, logits: Tensor):"),
    ("inference/text_generation_controllers/text_generation_controller.py", 906,
     "self._dynamic_step_sample_logits(logits)"),
    ("models/gpt/gpt_model.py", 664,
     "if in_inference_mode and inference_context.materialize_only_last_token_logits:"),
    ("inference/contexts/dynamic_context.py", 626, "self.request_kv_length_offsets = torch.empty_like(self.request_ids)"),
    ("inference/contexts/dynamic_context.py", 1518, "def last_token_logits(self, logits: Tensor) -> Tensor:"),
    ("inference/engines/dynamic_engine.py", 1030,
     "result = self.stop_word_finished_request_ids & set(active_request_ids)"),
]
# tp_collectives.GroupCollectives wraps the entry points megatron-core's TP mappings reduce and gather
# through (counting a served step's TP collectives: megatron.inference.observability.SpanRecorder).
TP_COLLECTIVE_SITES = [
    ("tensor_parallel/mappings.py", 12, "dist_all_gather_func = torch.distributed.all_gather_into_tensor"),
    ("tensor_parallel/mappings.py", 13, "dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor"),
    ("tensor_parallel/mappings.py", 31, "torch.distributed.all_reduce(input_.contiguous(), group=group)"),
    ("tensor_parallel/mappings.py", 92, "dist_all_gather_func(output, input_.contiguous(), group=group)"),
]
# CpuEvent.elapsed_time (cpu_device.py): the engines time their steps with CUDA events.
CPU_EVENT_SITES = [
    ("inference/text_generation_controllers/text_generation_controller.py", 1361,
     "timing_events[i].elapsed_time(timing_events[i + 1]) / 1e3"),
]

# moe_variants/builder.py `fusions`: which fused kernels exist, as megatron-core resolved them at
# import, and the upstream rules that keep some fusions off (see the comments there).
FUSION_SITES = [
    ("models/common/embeddings/rope_utils.py", 23, "fused_apply_rotary_pos_emb = None"),
    ("transformer/moe/moe_utils.py", 28, "fused_permute,"),
    ("transformer/moe/moe_utils.py", 32, "fused_topk_with_score_function,"),
    ("transformer/moe/moe_utils.py", 652, "if fused:"),  # the fused top-k skips router_replay (:702)
    ("tensor_parallel/layers.py", 48, "_grad_accum_fusion_available = False"),
    ("transformer/transformer_config.py", 1492, "self.activation_func == F.gelu"),
    ("transformer/transformer_config.py", 2068,
     'if self.multi_latent_attention and self.apply_rope_fusion and self.rope_type != "yarn":'),
]

# moe_variants/common/wgrad.py: why the deferral is off with --overlap-grad-reduce (DDP's backward
# hook asserts a gradient and launches a bucket once all its parameters fired), and why
# megatron-core's own delay_wgrad_compute (Transformer Engine grouped GEMM) is not used for it:
# upstream allows it only with overlap_moe_expert_parallel_comm (its combined 1F1B schedule).
WGRAD_SITES = [
    ("distributed/distributed_data_parallel.py", 435, "param.grad is not None"),
    ("distributed/distributed_data_parallel.py", 444, "self.param_to_bucket_group[param].register_grad_ready("),
    ("distributed/param_and_grad_buffer.py", 531, "assert self.grad_reduce_handle is not None, ("),
    ("transformer/transformer_config.py", 1911, "self.overlap_moe_expert_parallel_comm"),
]

# The in-process checkpoint writer (dist_ckpt.py): the Manager-owned results queue read through a
# module global, the per-save writer processes, and the shape of the save function it rebinds.
DIST_CKPT_WRITER_SITES = [
    ("dist_checkpointing/strategies/filesystem_async.py", 48, "_results_queue = None"),
    ("dist_checkpointing/strategies/filesystem_async.py", 55, "_results_queue = ctx.Manager().Queue()"),
    ("dist_checkpointing/strategies/filesystem_async.py", 185, "self.results_queue = _get_write_results_queue()"),
    ("dist_checkpointing/strategies/filesystem_async.py", 206,
     "partial(self.write_preloaded_data_multiproc, transform_list, self.use_msc),"),
    ("dist_checkpointing/strategies/filesystem_async.py", 266, 'ctx = mp.get_context("fork")'),
    # the writer called through __wrapped__ in a thread (no process-wide gc.disable); CPU tensors
    # are not copied when planned, so checkpointing's async save copies them itself
    ("dist_checkpointing/strategies/filesystem_async.py", 341, "@_disable_gc()"),
    ("dist_checkpointing/strategies/filesystem_async.py", 151, "return ten.clone() if is_view else ten"),
]
