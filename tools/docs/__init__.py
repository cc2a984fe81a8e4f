"""The documentation's own tools: ``python -m tools.docs <command>``.

* ``check``       broken relative links and anchors, history words, oversized pages in README.md
                  and docs/ (``check.py``)
* ``reference``   write docs/reference/ from the code: the entry points' flags, the config sections,
                  the server's routes, the JSON schemas the tools write; ``--check`` compares
                  instead (``reference.py``)
* ``run-guides``  run the ```bash blocks docs/guides/ marks ``<!-- ci: run -->``, each page in a
                  fresh copy of the repository (``guides.py``)
* ``claims``      the figures the docs quote, checked against the JSON under docs/figures/ they
                  come from (tests/docs/claims.yaml; ``claims.py``)

``make check-docs`` runs ``check`` and ``reference --check``; ``make docs`` builds the site with
mkdocs (``mkdocs.yml``).
"""
