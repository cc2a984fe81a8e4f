"""Checkpoint conversion (Hugging Face <-> this project) and FCSD self-distillation."""

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)
