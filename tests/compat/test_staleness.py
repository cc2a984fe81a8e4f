"""The compat seam is explicit, idempotent, and fails loudly when megatron-core changes under it.

Each adaptation names the upstream source it works around as ``Site(path, function, text)`` pins
(megatron/compat/sites.py). After a megatron-core upgrade these tests fail, naming the file, the
function and the text, for each pin whose text changed or left its function (code that only moved
passes): re-check the adaptation, then update or delete it.
"""

import importlib
import importlib.util
import os
import pkgutil
from functools import lru_cache

import pytest
import torch

from megatron import compat
from megatron.compat import sites


def _core_root():
    import megatron.core

    return os.path.dirname(megatron.core.__file__)


def site_lists() -> dict[str, list]:
    """Every module-level ``*_SITES`` list of the megatron.compat package, by ``module.NAME``."""
    found, seen = {}, set()
    for info in pkgutil.iter_modules(compat.__path__):
        module = importlib.import_module(f"megatron.compat.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_SITES") and id(value) not in seen:
                seen.add(id(value))
                found[f"{module.__name__}.{name}"] = value
    return found


@lru_cache(maxsize=None)
def _upstream_source(path: str) -> str:
    with open(os.path.join(_core_root(), path)) as f:
        return f.read()


def test_version_is_the_checked_one():
    assert compat.megatron_core_version() == sites.CHECKED_VERSION, (
        "megatron-core changed: review megatron/compat/sites.py against the new source"
    )


@pytest.mark.parametrize("site", [site for pins in site_lists().values() for site in pins], ids=str)
def test_upstream_site_unchanged(site):
    assert isinstance(site, sites.Site), f"{site!r}: pins are sites.Site(path, function, text)"
    problem = sites.site_problem(site, _upstream_source(site.path))
    assert problem is None, f"{problem}; the adaptation that works around it may be stale"


def test_pins_survive_an_upgrade_that_only_moves_code():
    """Every pin still holds on its upstream file shifted down by a new license header: moved code
    reports nothing."""
    header = "# a new header\n" * 7
    pins = [site for pins in site_lists().values() for site in pins]
    assert [sites.site_problem(site, header + _upstream_source(site.path)) for site in pins] == [None] * len(pins)


@pytest.mark.parametrize("path", sites.TORCH_PRIVATE_APIS)
def test_torch_private_api_exists(path):
    """The private torch APIs the project uses (through megatron/compat/autograd.py and sdpa.py) still exist."""
    head, _, attr = path.rpartition(".")
    if head == "<grad_fn>":
        obj = (torch.ones(1, requires_grad=True) * 2).grad_fn
    else:
        import importlib

        parts = head.split(".")
        obj = importlib.import_module(parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    assert hasattr(obj, attr), f"torch {torch.__version__} no longer has {path}; re-check megatron/compat/autograd.py and sdpa.py"


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
