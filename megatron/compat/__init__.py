"""The single seam that adapts megatron-core 0.16.1 to this project.

Call ``megatron.compat.apply()`` once, explicitly, before building models (our entry points and
the test harness do). It is idempotent. Two kinds of adaptation exist:

- **bug fixes**, active everywhere: ``te_general_gemm`` is undefined without Transformer Engine
  (``transformer/moe/moe_utils.py:22-39`` vs ``:1192``), so the router's gating GEMM raises a
  NameError on any machine without TE, GPU included. Upstream main defines it as ``None``; so do we.
  And the distributed optimizer cannot reload its own checkpoint with torch's Adam (no apex/TE):
  the loader leaves each parameter's ``step`` out of what it reads (step lives in the param groups)
  but then copies every key of the optimizer's state, ``step`` included (``KeyError: 'step'``), and
  its ``load_state_dict`` hands every parameter's state one shared ``step`` tensor, which torch's
  Adam then increments once per parameter (a wrong bias correction from the first resumed step);
  ``_fix_distributed_optimizer_step`` keeps the state's own ``step`` and gives each its own tensor.
- **CPU execution**, active only when CUDA is unavailable: ``cpu_device.install()`` redirects the
  CUDA allocations, streams and type-string checks of megatron-core's DDP, optimizers, schedules
  and tensor-parallel mappings to the CPU (sites in ``sites.py``). Importing this package also
  installs an import hook that turns megatron-core's ``jit_fuser`` off (its own
  ``disable_jit_fuser``) where compiled functions would run eagerly anyway, so that importing
  megatron-core does not import dynamo and inductor (about 2 s per process).

Everything on the MoE hot path that needs CPU care (router gating device moves, asynchronous
all-to-alls) is handled by our own subclasses in ``moe_variants/common`` rather than by patches,
because those classes are where the project's behaviour lives anyway; where such a subclass would
have to override or read a private megatron-core name, the override lives here instead and gives
it a public name (``token_dispatcher``: the all-to-all split sizes; ``transformer_layer``: the
layer's MLP step; ``inference.sampling_controller_class``: the server's sampling step), so no code
outside this package touches megatron-core's private names (``tests/architecture/test_upstream_private.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from megatron.compat.sites import CHECKED_VERSION

__all__ = ["apply", "quiet_warnings", "AppliedCompat", "megatron_core_version", "CHECKED_VERSION"]

# Notices megatron-core and torch print for optional packages or internal deprecations that a user
# of this project cannot act on; Transformer Engine/apex being absent is reported by our own
# `--transformer-impl` resolution instead.
_QUIET = [
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*TransformerEngine.*not installed.*",
    r".*full scope is deprecated.*",
    r".*`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*",
    # every checkpoint load: megatron-core 0.16.1's torch_dist strategy calls torch's deprecated
    # `load_state_dict` on ShardedTensors (dist_checkpointing/strategies/torch.py:799)
    r".*`load_state_dict` is deprecated and will be removed in future versions.*",
    r".*Please use DTensor instead and we are deprecating ShardedTensor.*",
]


def quiet_warnings() -> None:
    """Silence the upstream notices above (idempotent). Importing this package calls it, so a
    module that imports ``megatron.compat`` before ``megatron.core`` never shows them; it only
    installs warning filters."""
    import warnings

    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)


quiet_warnings()


def _eager_on_cpu() -> bool:
    """Whether compiled functions would run eagerly here: no CUDA (``apply`` then disables dynamo,
    as eager is what CPU runs want) or dynamo disabled by the user."""
    import torch

    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        return True
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return os.environ["TORCHDYNAMO_DISABLE"] == "1"


class _JitFuserOff(importlib.abc.MetaPathFinder):
    """Calls megatron-core's own ``disable_jit_fuser()`` as soon as ``megatron/core/jit.py`` has run,
    before any fusion module decorates with ``jit_fuser`` (= ``torch.compile``). Each such decoration
    imports dynamo and inductor: about 2 of the 3 s that importing megatron-core takes, paid by every
    process, for functions that run eagerly where dynamo is disabled. Active only there."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit" or not _eager_on_cpu():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_disable
        return spec


if "megatron.core.jit" not in sys.modules and not any(isinstance(f, _JitFuserOff) for f in sys.meta_path):
    sys.meta_path.insert(0, _JitFuserOff())


@dataclasses.dataclass(frozen=True)
class AppliedCompat:
    """What ``apply`` did in this process."""

    cpu_device_redirect: bool
    te_general_gemm_fix: bool
    megatron_core_version: str


_applied: AppliedCompat | None = None


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _fix_te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _fix_distributed_optimizer_step() -> bool:
    """Two fixes to reloading megatron-core's distributed optimizer with torch's Adam (sites
    ``DIST_OPT_LOAD_SITES``): ``_set_main_param_and_optimizer_states`` given tensors without ``step``
    keeps the state's own ``step`` (restored from the param groups by ``load_state_dict``) instead of
    raising ``KeyError``; and after ``load_state_dict`` every parameter's ``step`` is a tensor of its
    own (upstream assigns one tensor to all, and Adam's in-place ``step += 1`` then counts it once
    per parameter)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict
    if getattr(original, "_keeps_step", False):
        return False

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    set_states._keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer.load_state_dict = load_state_dict
    return True


def apply(*, allow_version_mismatch: bool = False) -> AppliedCompat:
    """Apply the adaptations for this machine (idempotent) and return what is active."""
    global _applied
    if _applied is not None:
        return _applied
    import torch

    from megatron.compat import cpu_device

    quiet_warnings()
    version = megatron_core_version()
    if version != CHECKED_VERSION and not allow_version_mismatch:
        raise RuntimeError(
            f"megatron-core {version} is installed but megatron/compat was checked against "
            f"{CHECKED_VERSION}; run tests/compat/test_staleness.py and update megatron/compat/sites.py"
        )
    # jit_fuser = torch.compile (megatron/core/jit.py) adds seconds of compile time per shape on
    # CPU and interacts badly with the device mode; eager is what CPU runs want.
    # The environment variable covers every later torch.compile (and child processes); a function
    # compiled before it was set is covered by dynamo's config, if dynamo was imported at all.
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.config.disable = True
    te_fixed = _fix_te_general_gemm()
    _fix_distributed_optimizer_step()
    if cpu:
        cpu_device.install()
    _applied = AppliedCompat(
        cpu_device_redirect=cpu_device.is_installed(),
        te_general_gemm_fix=te_fixed,
        megatron_core_version=version,
    )
    return _applied


def have_transformer_engine() -> bool:
    """True if Transformer Engine is importable (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def prepare_optimizer_for_load(optimizer) -> None:
    """Give a fresh optimizer the state entries a distributed-checkpoint load expects.

    Without apex/Transformer Engine, megatron-core's ``DistributedOptimizer.state_dict`` reads the
    ``step`` of every torch-Adam state and asserts they agree (``optimizer/distrib_optimizer.py:641-642``);
    a freshly built optimizer has no state yet, so building the *loading* sharded state dict fails.
    megatron-core's own ``_init_optimizer_states_with_dummy_values`` (``:1137``) creates them with a
    zero-gradient step; the loaded values then overwrite them. Call before loading, and load the
    model weights after it (the dummy step applies weight decay to the current weights).
    """
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for opt in inner:
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def prefixed_default_store(prefix: str):
    """The default process group's c10d store under ``prefix`` (torch keeps it private:
    ``distributed_c10d._get_default_store``). Under torchrun it is the launcher's agent store, so
    it stays reachable while any one rank is stopped or dead."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(prefix, distributed_c10d._get_default_store())
