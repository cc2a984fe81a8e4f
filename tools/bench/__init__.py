"""EP benchmark harness: ranks in network namespaces over a shaped link, launched and measured.

``scripts/bench_ep.py`` is the entry point; docs/design/measuring-communication.md explains the method.
"""
