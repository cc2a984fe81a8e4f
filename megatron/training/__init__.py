"""The training application: Megatron-LM style flags, loop, data, checkpoints, evaluate_lm."""

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)
