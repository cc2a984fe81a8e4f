"""megatron/compat's import hook: on a machine where compiled functions run eagerly (no CUDA, or
dynamo disabled by the user), megatron-core's ``jit_fuser`` is its own no-op, so importing
megatron-core imports neither dynamo nor inductor; a user who enables dynamo keeps torch.compile.
Fresh interpreters: the hook acts on the first import of megatron-core in a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import megatron.compat
import megatron.core.models.gpt.gpt_model, megatron.core.transformer.moe.moe_layer
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu
megatron.compat.apply()
print(json.dumps({"fuser": jit.jit_fuser.__name__, "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "geglu_is_plain": fused_bias_geglu.geglu.__module__ == fused_bias_geglu.__name__
                                    and not hasattr(fused_bias_geglu.geglu, "_torchdynamo_orig_callable")}))
"""


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**full, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the hook's default case is a machine without CUDA")
def test_without_cuda_megatron_core_imports_without_dynamo():
    assert _probe() == {"fuser": "noop_decorator", "inductor": False, "geglu_is_plain": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_user_who_enables_dynamo_keeps_torch_compile():
    probe = _probe(TORCHDYNAMO_DISABLE="0")
    assert probe["fuser"] == "compile" and probe["inductor"] and not probe["geglu_is_plain"]


def test_dynamo_disabled_by_the_user_turns_the_fuser_off_anywhere():
    assert _probe(TORCHDYNAMO_DISABLE="1")["fuser"] == "noop_decorator"
