"""What both applications (``megatron.training``, ``megatron.inference``) and the tools are built
from: the run's configs and their flags (``arguments``, ``config``), tokenizers (``tokenizer``),
process groups (``parallel``), the checkpoint format (``checkpointing``) and models from
checkpoints (``loading``). Imports neither application."""

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)
