"""The training application: the Megatron-LM style loop, its step, data, metrics, evaluate_lm (its
flags, configs and checkpoints are ``megatron.components``)."""

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)
