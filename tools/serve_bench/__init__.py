"""Serving benchmark building blocks (load generation, statistics, report shape); the driver
(scripts/bench_serve.py) is not built yet: see docs/serving.md, "Figures"."""
