# Set-up and the two commands a newcomer needs: `make demo` (the main job on the embedded default)
# and `make test` (the test suite; `make test-fast` for the unit tier). All install into a local
# virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned: 2.13.0 is the release the project is tested with (a CPU build on CPU-only
# machines; pip picks the CUDA build elsewhere).
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast clean

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

test: install
	$(PY) -m pytest -q

# the unit tier: everything but the multi-process end-to-end runs (marked slow); < 5 min on 2 cores
test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs
