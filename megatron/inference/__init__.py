"""Serving this project's checkpoints: megatron-core's dynamic inference engine behind an
OpenAI-compatible HTTP server (``python -m megatron.inference.serve``; docs/guides/serve.md)."""

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)
