"""EP benchmark harness: ranks in network namespaces over a shaped link, launched and measured.

``scripts/bench_ep.py`` is the entry point; docs/measuring_communication.md explains the method.
"""
