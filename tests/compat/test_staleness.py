"""The compat seam is explicit, idempotent, and fails loudly when megatron-core changes under it.

Each adaptation names the upstream lines it works around (megatron/compat/sites.py). After a
megatron-core upgrade these tests fail with the file:line that moved: re-check the adaptation,
then update or delete it.
"""

import importlib.util
import os

import pytest
import torch

from megatron import compat
from megatron.compat import sites


def _core_root():
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def test_version_is_the_checked_one():
    assert compat.megatron_core_version() == sites.CHECKED_VERSION, (
        "megatron-core changed: review megatron/compat/sites.py against the new source"
    )


@pytest.mark.parametrize(
    "path,line,text",
    sites.CPU_DEVICE_SITES + sites.TE_GENERAL_GEMM_SITES + sites.DIST_OPT_LOAD_SITES
    + sites.UPSTREAM_COUPLING_SITES + sites.INFERENCE_SITES + sites.CPU_EVENT_SITES
    + sites.FUSION_SITES + sites.WGRAD_SITES + sites.DIST_CKPT_WRITER_SITES + sites.SERVING_SITES
    + sites.TP_COLLECTIVE_SITES,
    ids=lambda v: str(v) if not isinstance(v, str) or "/" in v else None,
)
def test_upstream_site_unchanged(path, line, text):
    with open(os.path.join(_core_root(), path)) as f:
        lines = f.read().splitlines()
    assert line <= len(lines) and text in lines[line - 1], (
        f"megatron/core/{path}:{line} no longer reads {text!r}; the adaptation that works around "
        f"it may be stale"
    )


@pytest.mark.parametrize("path", sites.TORCH_PRIVATE_APIS)
def test_torch_private_api_exists(path):
    """The private torch APIs the project uses (through megatron/compat/autograd.py) still exist."""
    head, _, attr = path.rpartition(".")
    if head == "<grad_fn>":
        obj = (torch.ones(1, requires_grad=True) * 2).grad_fn
    else:
        import importlib

        parts = head.split(".")
        obj = importlib.import_module(parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    assert hasattr(obj, attr), f"torch {torch.__version__} no longer has {path}; re-check megatron/compat/autograd.py"


def test_te_general_gemm_still_undefined_without_te():
    """The upstream bug (NameError without Transformer Engine) is still present."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine installed: the name is defined upstream")
    import megatron.core.transformer.moe.moe_utils as mu

    with open(mu.__file__) as f:
        source = f.read()
    try_block = source.split("except ImportError:", 1)[1].split("\n\n", 1)[0]
    assert "te_general_gemm" not in try_block, "upstream now defines te_general_gemm without TE"


def test_apply_is_idempotent_and_reports():
    first = compat.apply()
    second = compat.apply()
    assert first is second
    assert first.megatron_core_version == sites.CHECKED_VERSION
    assert first.cpu_device_redirect == (not torch.cuda.is_available())
    import megatron.core.transformer.moe.moe_utils as mu

    assert hasattr(mu, "te_general_gemm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the redirect exists only on CPU machines")
def test_cpu_redirect_covers_megatron_allocations():
    compat.apply()
    x = torch.zeros(2, device="cuda")
    assert x.device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert x.cuda() is x
    assert x.type() == "torch.cuda.FloatTensor"  # what megatron-core's optimizers check
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64
    assert x.to("cuda").device.type == "cpu"
