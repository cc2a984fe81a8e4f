"""Where a training step's time goes: ``torch.profiler`` time per category of the model's modules.

``label_modules(model)`` wraps every module of a known kind in a ``record_function`` range named
``breakdown::<category>`` (forward hooks) and ``label_optimizer(optimizer)`` wraps its ``step``.
``categorise(events)`` then gives each profiled operator's own time to the innermost category
range around it; backward operators, which run outside any forward range, take the category of
the forward operator that created their autograd node (the profiler records the node's sequence
number on both: the link PyTorch's own trace viewer draws). Time is device (kernel) time on a GPU
and host time on the CPU; ``idle`` is the step's wall time left over: on a GPU the time no kernel
ran (host overhead, launch gaps, synchronisation), on the CPU the time outside every operator's own
time (Python and framework overhead).

Categories: attention (the core attention: scores, softmax, values), expert GEMMs (the routed
experts), permutation/dispatch (what an MoE layer does outside its router and experts: sorting,
gathers and scatters, all-to-alls, probability weighting), router, dense GEMMs (every other linear
layer: QKV and output projections, shared experts, dense MLPs, the output layer), norms and
elementwise (normalisations, residual additions, rotary embeddings, activations), loss and
embedding, optimizer, other (the rest: gradient reduction, zeroing, the backward engine).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Optional

import torch

__all__ = ["CATEGORIES", "category_of", "label_modules", "label_optimizer", "categorise", "profile_steps"]

CATEGORIES = ("attention", "expert GEMMs", "permutation/dispatch", "router", "dense GEMMs",
              "norms and elementwise", "loss and embedding", "optimizer", "other")
PREFIX = "breakdown::"


def category_of(module: torch.nn.Module) -> Optional[str]:
    """The category of a module's own work, or None for modules that only group others."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from moe_variants.common.experts import GroupedExperts

    name = type(module).__name__
    if isinstance(module, DotProductAttention) or name == "TEDotProductAttention":
        return "attention"
    if isinstance(module, (GroupedExperts, SequentialMLP)) or name == "TEGroupedMLP":
        return "expert GEMMs"
    if isinstance(module, TopKRouter):
        return "router"
    if isinstance(module, MoELayer):
        return "permutation/dispatch"
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name.startswith("TE") and "Linear" in name:
        return "dense GEMMs"
    if "Norm" in name:
        return "norms and elementwise"
    if isinstance(module, (LanguageModelEmbedding, GPTModel)):
        return "loss and embedding"
    if isinstance(module, TransformerLayer) or "Attention" in name or "MLP" in name:
        return "norms and elementwise"
    return None


@contextlib.contextmanager
def label_modules(model: torch.nn.Module):
    """Profiler ranges around the forward of every module ``category_of`` names (see module doc)."""
    stack = []
    handles = []

    def enter(category):
        def hook(module, args):
            scope = torch.profiler.record_function(PREFIX + category)
            scope.__enter__()
            stack.append(scope)
        return hook

    def leave(module, args, output):
        if stack:
            stack.pop().__exit__(None, None, None)

    for module in model.modules():
        category = category_of(module)
        if category is not None:
            handles.append(module.register_forward_pre_hook(enter(category)))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


@contextlib.contextmanager
def label_optimizer(optimizer):
    """A ``breakdown::optimizer`` range around ``optimizer.step`` (an instance attribute, removed
    on exit)."""
    step = optimizer.step

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + "optimizer"):
            return step(*args, **kwargs)

    optimizer.step = labelled
    try:
        yield
    finally:
        del optimizer.step


def _own_category(event) -> Optional[str]:
    """The innermost category range around ``event`` (itself included)."""
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX):]
        event = event.cpu_parent
    return None


def _is_backward_node(event) -> bool:
    return event.name.startswith("autograd::engine::evaluate_function")


def categorise(events: Iterable, *, device: bool) -> dict:
    """{category: seconds} of the operators' own time (device time when ``device``, host time
    otherwise) in a profiler's ``events()`` (see the module docstring)."""
    events = list(events)
    forward_category = {}  # autograd sequence number -> category of the forward op that made the node
    for event in events:
        if getattr(event, "sequence_nr", -1) >= 0 and not _is_backward_node(event):
            category = _own_category(event)
            if category is not None:
                forward_category.setdefault(event.sequence_nr, category)
    totals = defaultdict(float)
    for event in events:
        if event.name.startswith(PREFIX):
            continue
        own = (getattr(event, "self_device_time_total", 0.0) if device else event.self_cpu_time_total)
        if not own:
            continue
        category = _own_category(event)
        if category is None:
            node = event
            while node is not None and not _is_backward_node(node):
                node = node.cpu_parent
            if node is not None:
                category = forward_category.get(node.sequence_nr)
        totals[category or "other"] += own / 1e6
    return {name: totals.get(name, 0.0) for name in CATEGORIES}


def profile_steps(step, model: torch.nn.Module, optimizer, *, steps: int) -> dict:
    """Run ``step()`` ``steps`` times under the profiler with the labels above; per step:
    ``{"seconds": {category: s}, "shares": {category: fraction}, "wall_s", "kind"}``."""
    import time

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with label_modules(model), label_optimizer(optimizer):
        step()  # one untimed step: the labels' first call, allocator warm-up
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps
    seconds = {k: v / steps for k, v in categorise(prof.events(), device=cuda).items()}
    seconds["idle"] = max(wall - sum(seconds.values()), 0.0)
    total = sum(seconds.values())
    return {"kind": "device (kernel) time" if cuda else "host time", "wall_s": wall, "seconds": seconds,
            "shares": {k: v / total for k, v in seconds.items()} if total else {}}
