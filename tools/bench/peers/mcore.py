"""megatron-core's own latent MoE and EP overlap as EP benchmark peers (GPU only).

``mcore-latent`` (the BigMac peer): megatron-core 0.16.1's latent MoE, ``moe_latent_size`` on
``TransformerConfig`` (``MoELayer.fc1_latent_proj``/``fc2_latent_proj``, TE ``TELinear``,
``moe_layer.py:170``; ``TEGroupedMLP`` experts at the latent width, ``experts.py:544``), built from
megatron-core's own Transformer Engine spec with its own ``MoELayer``, router and all-to-all
dispatcher (``build_model(upstream_moe=True)``). Its shape is what the BigMac variant gives as
its upstream equivalent (``Variant.upstream_moe_config``): latent ``r x H`` and expert FFN
``F / r`` from the BigMac section of the same config, so the two differ only in whose code runs.
Upstream asserts ``HAVE_TE`` for the projections, hence GPU + TE.

``mcore-ep-overlap`` (the FarSkip peer): megatron-core's EP all-to-all overlap,
``overlap_moe_expert_parallel_comm=True`` + ``delay_wgrad_compute=True`` (``model_parallel_config.py:264-269``):
the no-pipelining schedule switches to ``combined_1f1b_schedule_for_no_pipelining``
(``schedules.py:598``), which runs micro-batch i+1's forward beside micro-batch i's backward on two
CUDA streams and needs the forward step to return ``GPTModel.build_schedule_plan(...)`` when asked
(``combined_1f1b.py:342``). Upstream requires EP > 1, bf16 or fp16, the alltoall dispatcher and no
recomputation (``transformer_config.py:1852-1920``); ``delay_wgrad_compute`` needs TE's grouped
GEMM. The peer therefore sets ``bf16`` and needs >= 2 GPUs (one per rank) and at least two
micro-batches per step (one runs alone; the overlap is between the others).

Counting: the all-to-alls are upstream's (``tensor_parallel.mappings.all_to_all`` ->
``torch.distributed.all_to_all_single``), not our counted dispatcher's, so for these peers the
worker observes ``torch.distributed.all_to_all_single`` in its process
(``megatron.common.collectives.observe_all_to_all_single``, :class:`TorchAllToAllCounter`) and
counts the off-rank bytes from the split sizes: 2-D hidden-state tensors in forward alternate
dispatch, combine; calls made with grad mode off (autograd's backward) are backward; 1-D tensors are
routing probabilities (metadata). Their all-to-all *time* is not measured (the calls are upstream's,
on its streams, where our CUDA events are not): ``a2a_time_s`` and ``exposed_comm_s`` read 0 for
them; compare step times (CUDA events, as for every variant) and bytes, and use Nsight Systems for
the overlap. Our variants on the same run keep their own counters (CUDA-event times on GPU).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["refusal", "WorkerHooks", "TorchAllToAllCounter", "peer_config_overrides", "schedule_plan_forward_step"]

LATENT = "mcore-latent"
OVERLAP = "mcore-ep-overlap"
TE_HINT = "pip install -e '.[gpu]' or an NGC PyTorch container"


def refusal(variant: str, device: str, ranks: int) -> Optional[str]:
    """One line naming what is missing, or None. Checked in the CLI before any launch."""
    from tools.bench.peers import have_module

    what = ("megatron-core's latent MoE builds its projections with Transformer Engine" if variant == LATENT
            else "megatron-core's EP overlap runs the all-to-alls on CUDA streams")  # fmt: skip
    if device != "cuda":
        return f"--variants {variant} runs on GPUs only ({what}): add --device cuda on a machine with CUDA GPUs"
    import torch

    if not torch.cuda.is_available():
        return f"--variants {variant} needs CUDA GPUs ({what}); torch.cuda.is_available() is False here"
    if not have_module("transformer_engine"):
        return f"--variants {variant} needs Transformer Engine, which is not installed ({TE_HINT})"
    if torch.cuda.device_count() < ranks:
        return f"--variants {variant}: --ranks {ranks} needs one GPU per rank, {torch.cuda.device_count()} visible"
    if variant == OVERLAP and ranks < 2:
        return f"--variants {variant} overlaps the expert-parallel all-to-all: it needs --ranks >= 2 (EP > 1)"
    return None


def peer_config_overrides(variant: str, model) -> dict:
    """``TransformerConfig`` fields the peer sets on top of the model's own (see the docstring)."""
    if variant == LATENT:
        from tools import variants as variant_hooks

        latent = {name: c for name, c in variant_hooks.upstream_moe_configs(model).items() if "moe_latent_size" in c}
        if len(latent) != 1:
            raise ValueError(f"--variants {LATENT} takes its shape from the registered variant whose upstream "
                             f"equivalent is megatron-core's latent MoE; {len(latent)} offer one ({', '.join(latent)})")
        return next(iter(latent.values()))
    if variant == OVERLAP:
        return {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    raise ValueError(f"not an upstream peer: {variant}")


def schedule_plan_forward_step(timer=None):
    """``lm_forward_step`` that also answers the combined 1F1B schedule's
    ``forward_step_func(data_iterator, model, return_schedule_plan=True)`` with
    ``(model.build_schedule_plan(...), loss_func)``."""
    import time

    from megatron.components.parallel import device
    from megatron.training.step import masked_mean, to_device
    from moe_variants.builder import causal_attention_mask

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        start = time.perf_counter()
        batch = to_device(next(data_iterator), device())
        tokens = batch["tokens"]
        args = (tokens, batch["position_ids"], causal_attention_mask(tokens.shape[1], device=tokens.device))
        if return_schedule_plan:
            output = model.build_schedule_plan(*args, labels=batch["labels"])
        else:
            output = model(*args, labels=batch["labels"])

        def loss_func(per_token_loss):
            loss = masked_mean(per_token_loss.float(), batch["loss_mask"])
            return loss, {"lm_loss": loss.detach().clone()}

        if timer is not None:
            timer.forward_s += time.perf_counter() - start
        return output, loss_func

    return forward_step


class TorchAllToAllCounter:
    """Counts the bytes of every ``torch.distributed.all_to_all_single`` of this process through
    ``megatron.common.collectives.observe_all_to_all_single`` (see the module docstring).
    ``step_totals()`` returns the step's counters in ``comm_totals``' keys (times 0: not measured)
    and resets them; ``remove()`` stops observing."""

    KEYS = ("bytes_dispatch", "bytes_combine", "bytes_backward", "bytes_meta", "time_fwd_s", "time_bwd_s",
            "exposed_fwd_s", "exposed_bwd_s")  # fmt: skip

    def __init__(self):
        import torch
        import torch.distributed as dist

        from megatron.common.collectives import observe_all_to_all_single

        self._torch = torch
        self._reset()
        self.remove = observe_all_to_all_single(
            lambda tensor, splits, group: self.record(tensor, splits, dist.get_world_size(group),
                                                      dist.get_rank(group)))  # fmt: skip

    def _reset(self):
        self.totals = {k: 0 for k in self.KEYS}
        self._forward_hidden_calls = 0

    def record(self, tensor, input_splits, world: int, rank: int) -> None:
        """Book one call: ``tensor`` [N, ...] rows split by ``input_splits`` (equal when None)."""
        rows = tensor.shape[0]
        splits = [int(n) for n in input_splits] if input_splits else [rows // world] * world
        off_rank_rows = rows - splits[rank]
        row_bytes = (tensor.numel() // rows if rows else 0) * tensor.element_size()
        if tensor.dim() == 1:
            kind = "bytes_meta"
        elif not self._torch.is_grad_enabled():
            kind = "bytes_backward"
        else:
            kind = ("bytes_dispatch", "bytes_combine")[self._forward_hidden_calls % 2]
            self._forward_hidden_calls += 1
        self.totals[kind] += off_rank_rows * row_bytes

    def step_totals(self) -> dict:
        out = dict(self.totals)
        self._reset()
        return out


class WorkerHooks:
    """What the model worker does differently for the upstream peers (see tools.bench.variant_worker)."""

    def __init__(self, configs, pg_collection, options: dict):
        import torch

        from moe_variants.config import TransformerImpl

        self.variant = options["variant"]  # the worker has checked ``refusal`` already
        model = configs.model
        model.transformer_impl = TransformerImpl.transformer_engine
        if self.variant == OVERLAP:
            model.bf16 = True  # upstream: the overlap supports bf16/fp16 models only
            if configs.parallel.expert_model_parallel_size < 2:
                raise ValueError(f"--variants {OVERLAP} needs --expert-model-parallel-size >= 2")
        overrides = peer_config_overrides(self.variant, model)
        num_micro = configs.training.num_microbatches(configs.parallel.data_parallel_size(torch.distributed.get_world_size()))
        if self.variant == OVERLAP and num_micro < 2:
            raise ValueError(f"--variants {OVERLAP} overlaps one micro-batch's forward with another's backward: "
                             f"it needs >= 2 micro-batches per step (--global-batch-size), got {num_micro}")
        self.build_kwargs = {"upstream_moe": True, "config_overrides": overrides}
        self.forward_step_factory = schedule_plan_forward_step if self.variant == OVERLAP else None
        self.info = {"peer": self.variant, "transformer_config_overrides": overrides,
                     "a2a_time_measured": False}
        self.counter = TorchAllToAllCounter()

    def comm_totals(self, step_metrics) -> dict:
        """This step's all-to-all counters (replacing ``step_metrics.comm``, which upstream's layers
        do not fill): bytes from the torch-level observer, times 0."""
        return self.counter.step_totals()

    def before_wrap(self, model) -> None:
        pass

    def step_extra(self, model_chunks) -> dict:
        return {}
