"""``scripts/profile_bigmac_layer.py`` runs both models side by side and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

# runs the profiling script
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = """num_layers: 1
hidden_size: 32
num_attention_heads: 4
ffn_hidden_size: 64
seq_length: 16
max_position_embeddings: 16
vocab_size: 64
num_experts: 4
moe_router_topk: 2
moe_ffn_hidden_size: 16
moe_token_dispatcher_type: alltoall
bigmac_ratio: 0.25
micro_batch_size: 2
global_batch_size: 2
"""


def test_profile_script_writes_both_variants(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "profile_bigmac_layer.py"), "--config", str(cfg),
         "--repeats", "1", "--with-upstream-scaling", "--gemm-rows", "8", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for variant in ("standard", "bigmac", "bigmac_upstream_scaling"):
        r = data["results"][variant]
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["profile_matmul_ms"] > 0 and r["backward_ops_ms"]
    assert len(data["gemms"]) == 12
    assert set(data["ratios_bigmac_over_standard"]) == {"fwd_ms", "bwd_ms", "profile_matmul_ms", "profile_other_ms"}


def test_profile_script_rejects_a_missing_config(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "profile_bigmac_layer.py"), "--config", str(tmp_path / "no.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "no such file" in proc.stderr
