# Set-up and the two commands a newcomer needs: `make demo` (the main job on the embedded default)
# and `make test` (the test suite; `make test-fast` for the unit tier). All install into a local
# virtual environment first. `make docs` builds the documentation site (`make docs-serve` serves it, with
# search), `make check-docs` checks the docs' links, words, sizes and generated reference.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned: 2.13.0 is the release the project is tested with (a CPU build on CPU-only
# machines; pip picks the CUDA build elsewhere).
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast docs docs-serve check-docs clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,data,eval,serve,deepspeed]"
	touch $@

# the checkpoint directory is named here, not in the YAML (variant runs on the YAML write nowhere
# unless given --save); --load of the --save directory (Megatron-LM's idiom): a second `make demo`
# resumes (and, when the first one finished, only evaluates) instead of colliding with the first
# run's checkpoints
demo: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 -m megatron.training.pretrain_gpt \
		--config examples/tiny_moe_cpu.yaml --save runs/tiny_moe_cpu --load runs/tiny_moe_cpu --save-interval 100

# everything in one run on three pytest workers: whole files (a file's module fixtures are built once;
# each guide page is a unit of its own), the longest end-to-end files first (tests/conftest.py), the
# unit tier's short files after them, filling the time the end-to-end runs wait (rank start-up, fault
# deadlines) and balancing the end; the 30 longest durations are listed
test: install
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=30

# the unit tier: everything but the multi-process end-to-end runs (marked slow); < 5 min on 2 cores
test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow"

# the site: mkdocs (the `docs` extra, installed on first use) builds docs/ into site/; --strict makes
# a link to a missing page or anchor an error (not with -q: mkdocs 1.6 then counts no warnings)
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# the same site served at http://127.0.0.1:8000, rebuilt on every edit (site/ also opens from disk:
# mkdocs.yml's offline plugin)
docs-serve: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# broken links and anchors, history words, oversized pages; docs/reference/ as the code generates it
check-docs: install
	$(PY) -m tools.docs check
	$(PY) -m tools.docs reference --check

clean:
	rm -rf $(VENV) runs site
