"""Multi-latent attention without Transformer Engine (megatron-core 0.16.1).

``multi_latent_attention.py:54-65`` imports ``TELinear`` from ``megatron.core.extensions.
transformer_engine``, which without TE still imports: it subclasses a ``MagicMock`` stand-in
(``extensions/transformer_engine.py:61-77``, ``:470``), so ``HAVE_TE`` ends up True and ``TELinear``
is a mock instance. ``MLASelfAttention.__init__`` then calls ``isinstance(self.linear_proj,
TELinear)`` (``:184-185``), which raises ``TypeError``: MLA cannot be built at all without TE.
The flag only gates that FP8 memory tweak for TE linears, so setting it to its true value (False)
is the whole fix. Applied explicitly by the model builder when it builds MLA; idempotent.
"""

from __future__ import annotations

import importlib.util

__all__ = ["apply_mla_without_te", "MLA_WITHOUT_TE_SITES"]

# (path relative to megatron/core, 1-based line, text expected there); see compat/sites.py
MLA_WITHOUT_TE_SITES = [
    ("transformer/multi_latent_attention.py", 62, "HAVE_TE = True"),
    ("transformer/multi_latent_attention.py", 184, "HAVE_TE"),
    ("transformer/multi_latent_attention.py", 185, "and isinstance(self.linear_proj, TELinear)"),
    ("extensions/transformer_engine.py", 76, "te = MagicMock()"),
]


def apply_mla_without_te() -> bool:
    """Correct ``multi_latent_attention.HAVE_TE`` when Transformer Engine is absent. Returns
    whether it had to."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    from megatron.core.transformer import multi_latent_attention

    changed = multi_latent_attention.HAVE_TE
    multi_latent_attention.HAVE_TE = False
    return bool(changed)
