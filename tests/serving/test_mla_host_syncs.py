"""An MLA prefill step reads its host values once, not once per layer.

Serving MLA from the latent cache uncompresses only the blocks of the step's requests
(megatron/compat/mla.py); finding them copies the step's key lengths to the host and takes the
unique block ids, each a device sync on a GPU. A tiny MLA model served by the engine (one rank,
the server's code path) is run for one prefill step under a ``TorchFunctionMode`` that counts the
calls which copy device values to the host (``tolist``, ``item``, ``unique``, ``nonzero``, tensor
truth and number conversions), by the file that made them: those made by megatron/compat/mla.py
are the same for 2 and 4 layers (one key-length read and one unique per step). The engine's own
per-step bookkeeping, the MoE layers' split sizes and the plain-torch kernels standing in for
flash-attn are not counted: they are not the MLA path's.
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

SYNCS = {torch.Tensor.tolist, torch.Tensor.item, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
         torch.nonzero, torch.Tensor.nonzero, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
         torch.Tensor.__float__}
TORCH_DIR = os.path.dirname(torch.__file__)


class HostSyncs(TorchFunctionMode):
    """Counts the host syncs above by the file of the innermost caller outside torch."""

    def __init__(self):
        super().__init__()
        self.by_file = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            frame = sys._getframe(1)
            while frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            self.by_file[frame.f_code.co_filename] += 1
        return func(*args, **(kwargs or {}))


def prefill_syncs_rank(rank, world_size, root: str, num_layers: int) -> tuple[int, int]:
    """Host syncs over the first (prefill) step of a ``num_layers`` MLA model's engine: (made by
    megatron/compat/mla.py, all)."""
    from megatron.compat import mla
    from megatron.core import parallel_state
    from megatron.inference.engine import EngineConfig, RankEngine, build_engine
    from megatron.inference.sampling import RequestSampling
    from megatron.training.loading import load_model
    from megatron.training.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig
    from tests.eval.conftest import save_tiny

    ckpt = os.path.join(root, f"mla{num_layers}")
    save_tiny(ckpt, dict(num_layers=num_layers, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
                         qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, seq_length=128))
    parallel_state.destroy_model_parallel()
    parallel = ParallelConfig()
    pgc = initialize_parallel(parallel, seed=0)
    model, configs, tokenizer, _ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
    engine = RankEngine(*build_engine(model, configs, tokenizer, pgc, EngineConfig(kv_cache_gb=0.01)), model)
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11], [12] * 70]):  # the last spans two cache blocks
        engine.add(i, prompt, max_tokens=2, sampling=RequestSampling(), termination_id=tokenizer.eod)
    with HostSyncs() as syncs:
        engine.step()
    return syncs.by_file[mla.__file__], sum(syncs.by_file.values())


def test_mla_prefill_syncs_once_per_step_not_per_layer(tmp_path):
    from tools.spawn import run_distributed

    counts = {n: run_distributed(prefill_syncs_rank, 1, str(tmp_path), n, timeout_s=300)[0] for n in (2, 4)}
    assert counts[2][0] > 0, counts  # the step was a prefill through the latent cache, and the counter sees it
    assert counts[4][0] == counts[2][0], counts
