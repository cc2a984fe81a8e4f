"""The serving benchmark (``scripts/bench_serve.py``): load generation and statistics (``loadgen``),
requests (``workload``), the HTTP load client (``client``), phase statistics (``analysis``), plots
and the driver (``cli``). See docs/guides/bench-serve.md."""
