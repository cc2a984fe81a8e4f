"""A variant from outside the repository: a package built here, in a temporary directory, with an
entry point in the group ``moe_variants``, installed with pip into a folder of its own (no network,
the environment left as it was), is trained by ``pretrain_gpt`` (torchrun, EP = 2), saved, loaded
and served by ``megatron.inference.serve``, and no file of this repository changes.

The package is the guide's, written by its own block (docs/guides/own-variant.md): LayerScale on
the MoE branch, a learned per-channel scale of each MoE layer's output (``--moe-variant layerscale``,
``--layerscale-init``). Checked: its config section is stored in the checkpoint's manifest, its
parameter in the dist-checkpoint; the server (a fresh process that finds the plugin again through
its entry point) answers a greedy completion with the tokens the offline reference generates from
the same checkpoint (exact: both run the same fp32 CPU arithmetic on the same weights); without
the plugin on the path the server refuses the checkpoint in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import SMALL_PRETRAIN_ARGS, torchrun

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GUIDE = os.path.join(REPO, "docs", "guides", "own-variant.md")
PROMPT = "First Citizen:"
MAX_TOKENS = 12


def _git_status() -> str | None:
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True)
    return proc.stdout if proc.returncode == 0 else None


def _build_and_install(root) -> str:
    """Write the package as the guide's block does (into ``root/runs/moe-layerscale``) and
    pip-install it into ``root/site``; returns the latter."""
    from tools.docs.guides import guide_blocks

    blocks, _ = guide_blocks(open(GUIDE).read())
    script = next(b.script for b in blocks if "pyproject.toml" in b.script)
    subprocess.run(["bash", "-e", "-c", script], cwd=root, check=True, timeout=60)
    src, site = root / "runs" / "moe-layerscale", root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(site), str(src)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(site)


def _offline_reference(site: str, ckpt: str) -> list:
    code = ("import json, sys; from tests.serving.conftest import offline_greedy; "
            f"print(json.dumps(offline_greedy({ckpt!r}, [{PROMPT!r}], {MAX_TOKENS})[0][0][0]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([site, REPO])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_installed_package_adds_a_variant_that_trains_saves_loads_and_serves(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest
    from tests.serving.conftest import Server, post

    before = _git_status()
    site = _build_and_install(tmp_path)
    assert os.path.isfile(os.path.join(site, "moe_layerscale-0.1.0.dist-info", "entry_points.txt"))

    save = tmp_path / "ckpt"
    proc = torchrun("megatron.training.pretrain_gpt", SMALL_PRETRAIN_ARGS + [
        "--moe-variant", "layerscale", "--layerscale-init", 0.5, "--init-method-std", 0.5, "--train-iters", 2,
        "--eval-iters", 1,
        "--expert-model-parallel-size", 2, "--save", save, "--save-interval", 2, "--data-cache-path", tmp_path / "cache"],
        env={"PYTHONPATH": os.pathsep.join([site, REPO])})
    assert proc.returncode == 0, proc.stderr[-3000:]

    latest = find_latest_checkpoint(str(save))
    configs = read_manifest(latest, verify=False)["configs"]
    assert configs["model"]["moe_variant"] == "layerscale" and configs["layerscale"] == {"layerscale_init": 0.5}
    stored = FileSystemReader(latest).read_metadata().state_dict_metadata
    assert [k for k in stored if k.endswith("mlp.layerscale")], sorted(stored)[:20]

    reference = _offline_reference(site, str(save))
    monkeypatch.setenv("PYTHONPATH", site)  # the server's own process finds the plugin by its entry point
    server = Server(str(save), tmp_path)
    try:
        status, body = post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                             "temperature": 0, "return_token_ids": True})
    finally:
        assert server.stop() == 0, server.output()[-3000:]
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference, (body, reference)

    monkeypatch.delenv("PYTHONPATH")
    refused = subprocess.run([sys.executable, "-m", "megatron.inference.serve", "--load", str(save), "--port", "0"],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
    assert (refused.returncode, refused.stderr.strip()) == (
        2, "megatron.inference.serve: error: --moe-variant 'layerscale' is not one of: standard, bigmac")
    assert _git_status() == before
