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

# megatron-core's dynamic inference engine on CPU / without flash-attn (compat/inference.py).
from megatron.compat.inference import INFERENCE_SITES  # noqa: E402

# CpuEvent.elapsed_time (cpu_device.py): the engines time their steps with CUDA events.
CPU_EVENT_SITES = [
    ("inference/text_generation_controllers/text_generation_controller.py", 1361,
     "timing_events[i].elapsed_time(timing_events[i + 1]) / 1e3"),
]
