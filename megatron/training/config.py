"""Dataclass configs of the training application: optimisation, data, checkpoints, logging.

Field names are Megatron-LM's flag names with ``-`` -> ``_``. The model's own configs
(``ModelConfig``, ``ParallelConfig`` and the variants' sections) live in the model library,
``moe_variants.config``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from moe_variants.config import coerce_enums


class LRDecayStyle(str, enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    inverse_square_root = "inverse-square-root"
    WSD = "WSD"


@dataclasses.dataclass
class TrainingConfig:
    """Optimisation and schedule (Megatron-LM flag names)."""

    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None  # default: micro_batch_size x data-parallel size
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # default: train_iters
    lr_decay_style: LRDecayStyle = LRDecayStyle.cosine
    lr_wsd_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    optimizer: str = "adam"
    use_distributed_optimizer: bool = False
    # megatron-core DDP: reduce each gradient bucket during the backward as soon as it is complete
    # (off by default, as in Megatron-LM); turns FarSkip's deferred weight gradients off
    overlap_grad_reduce: bool = False
    seed: int = 1234

    def __post_init__(self):
        coerce_enums(self)

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Gradient-accumulation steps per optimizer step; raises if the batch sizes don't fit."""
        gbs = self.resolved_global_batch_size(data_parallel_size)
        per_step = self.micro_batch_size * data_parallel_size
        if gbs % per_step:
            raise ValueError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {data_parallel_size}"
            )
        return gbs // per_step


@dataclasses.dataclass
class DataConfig:
    """Where tokens come from. With no ``data_path`` the embedded tiny-shakespeare corpus and its
    tokenizer are used (preprocessed on first use into ``data_cache_path``)."""

    data_path: Optional[list] = None  # a prefix, or "w1 p1 w2 p2" weighted blend
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    data_cache_path: Optional[str] = None
    num_workers: int = 0
    heldout_text: Optional[list] = None  # text files scored for perplexity at the end (e.g. WikiText-2 test)


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    keep_last_checkpoints: Optional[int] = 2
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load weights only; start at iteration 0 with fresh data order


@dataclasses.dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    metrics_file: Optional[str] = None  # default SAVE/metrics.jsonl
    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_mode: str = "offline"
    wandb_save_dir: Optional[str] = None
    log_progress: bool = True
