"""Tools built on the model library and the applications: the EP and serving benchmarks
(``tools.bench``, ``tools.serve_bench``), the Sem-MoE passes (``tools.semmoe``), the profilers
(``tools.profile``), data preparation (``tools.data``), the docs' checks and generated reference
(``tools.docs``). ``scripts/`` holds their entry points.
See docs/ARCHITECTURE.md."""

import os

from megatron import compat  # noqa: F401  (first: its import quiets megatron-core's import-time notices)

__all__ = ["repo_root"]


def repo_root() -> str:
    """The checkout that holds these tools (the parent of ``tools/``): scripts and workers run from it."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
