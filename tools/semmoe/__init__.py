"""Sem-MoE tools: the offline passes and their command line (``python -m tools.semmoe``), the
model-side runs (profile, apply, LAR) and the EP-benchmark variant. The algorithms are in
``moe_variants.semmoe``."""
