"""Tools built on the model library and the training application: the EP benchmark harness
(``tools.bench``) and the Sem-MoE passes (``tools.semmoe``). See docs/ARCHITECTURE.md."""

import os

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)

__all__ = ["repo_root"]


def repo_root() -> str:
    """The checkout that holds these tools (the parent of ``tools/``): scripts and workers run from it."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
