"""Sem-MoE (semantic parallelism): profile-driven expert placement and token/request scheduling.

Modules: ``profile`` (activation profile format and builder), ``solver`` (Algorithm 1),
``baselines`` (contiguous, EPLB-style, MILP), ``methods`` (method registry), ``scheduling``
(Algorithms 2-3 and the shuffled reduce-scatter / all-gather), ``metrics`` (LAR, imbalance, bytes),
``tables`` (table format), ``cli`` (``python -m tools.semmoe``). See docs/design/semmoe.md.
"""
