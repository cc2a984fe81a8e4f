"""Dataclass configs of a run beside the model's: optimisation, data, checkpoints, logging.

Field names are Megatron-LM's flag names with ``-`` -> ``_``. The model's own configs
(``ModelConfig``, ``ParallelConfig`` and the variants' sections) live in the model library,
``moe_variants.config``. The docstring under a field is its flag's ``--help`` text.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from moe_variants.config import Choice, coerce_enums


class Optimizer(Choice):
    """megatron-core's optimizers (``OptimizerConfig.optimizer``)."""

    adam = "adam"
    sgd = "sgd"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class VerifyCheckpoint(str, enum.Enum):
    """What a checkpoint's manifest records and what is checked before it is loaded: ``full`` the
    sha256 of every file (each rank hashes a share), ``sizes`` every file's size and the
    ``.metadata`` file's sha256, ``off`` nothing (the file list and sizes are still recorded)."""

    full = "full"
    sizes = "sizes"
    off = "off"


class LRDecayStyle(str, enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    inverse_square_root = "inverse-square-root"
    WSD = "WSD"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclasses.dataclass
class TrainingConfig:
    """Optimisation and schedule (Megatron-LM flag names)."""

    micro_batch_size: int = 4
    """sequences per micro-batch on each data-parallel rank"""
    global_batch_size: Optional[int] = None
    """sequences per optimizer step over all ranks (gradient accumulation makes up the rest); default:
    micro-batch size x data-parallel size"""
    train_iters: int = 100
    """optimizer steps to train for (a resumed run continues up to this)"""
    lr: float = 3e-4
    """peak learning rate"""
    min_lr: float = 0.0
    """learning rate at the end of the decay"""
    lr_warmup_iters: int = 0
    """steps of linear warm-up from 0 to --lr"""
    lr_decay_iters: Optional[int] = None
    """steps over which the learning rate decays; default: --train-iters"""
    lr_decay_style: LRDecayStyle = LRDecayStyle.cosine
    """shape of the learning-rate decay"""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD: steps of the final decay phase"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    adam_beta1: float = 0.9
    """Adam beta1"""
    adam_beta2: float = 0.95
    """Adam beta2"""
    adam_eps: float = 1e-8
    """Adam epsilon"""
    clip_grad: float = 1.0
    """global gradient-norm clipping threshold (0: off)"""
    optimizer: Optimizer = Optimizer.adam
    """megatron-core optimizer"""
    use_distributed_optimizer: bool = False
    """shard optimizer state over data-parallel ranks (ZeRO-1)"""
    # megatron-core DDP's overlap (off by default, as in Megatron-LM)
    overlap_grad_reduce: bool = False
    """reduce each gradient bucket during the backward as soon as it is complete (turns deferred expert
    weight gradients off)"""
    seed: int = 1234
    """random seed (initialisation, data order, dropout)"""
    distributed_timeout_minutes: float = 10.0
    """timeout of torch.distributed collectives: a rank that waits longer on a hung or dead peer fails
    instead of blocking (Megatron-LM's flag)"""
    heartbeat_timeout: float = 30.0
    """seconds without a heartbeat after which a rank counts as lost (stopped, stuck holding the GIL, dead)
    and the job exits with code 3 (megatron/training/watchdog.py; 0: off)"""
    step_timeout: float = 180.0
    """seconds without a finished training step (grown to 5x the slowest recent step, at most
    --max-step-timeout; the first step may take 10x and does not count later; evaluation and saves have
    their own limits) after which the job dumps every stack and exits with code 3 (0: off)"""
    max_step_timeout: Optional[float] = None
    """the most --step-timeout grows to with slow steps (default: 5x --step-timeout)"""
    startup_timeout: float = 600.0
    """seconds from a rank's start to its first training step (building the model, loading the checkpoint
    and the data; after every restart too) after which the job dumps every stack and exits with code 3: a
    rank hung while starting, or waiting for one that is (0: off)"""
    save_timeout: float = 1800.0
    """seconds a checkpoint save may take (an --async-save's completion included) after which the job
    dumps every stack and exits with code 3: a save stuck on I/O or on a rank; the checkpoints saved before
    it stay complete (0: off)"""
    eval_timeout: float = 1800.0
    """seconds an evaluation (validation, test, held-out text) may take after which the job dumps every
    stack and exits with code 3: a collective waiting for a rank that is hung (0: off)"""
    peak_tflops: Optional[float] = None
    """the accelerator's peak dense TFLOP/s for MFU in the step line (default: known GPUs' bf16 peak; none
    on CPU)"""

    def __post_init__(self):
        coerce_enums(self)
        _check(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _check(self.global_batch_size is None or self.global_batch_size >= 1,
               f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        _check(self.train_iters >= 1, f"--train-iters must be a positive number of steps, got {self.train_iters}")
        _check(self.lr >= 0 and self.min_lr >= 0, f"--lr and --min-lr must be >= 0, got {self.lr} and {self.min_lr}")
        _check(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        _check(self.lr_decay_iters is None or self.lr_decay_iters >= 1,
               f"--lr-decay-iters must be >= 1, got {self.lr_decay_iters}")
        _check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _check(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _check(self.distributed_timeout_minutes > 0,
               f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")
        _check(self.heartbeat_timeout >= 0 and self.step_timeout >= 0,
               f"--heartbeat-timeout and --step-timeout must be >= 0, got {self.heartbeat_timeout} and {self.step_timeout}")
        for flag in ("startup_timeout", "save_timeout", "eval_timeout"):
            _check(getattr(self, flag) >= 0, f"--{flag.replace('_', '-')} must be >= 0, got {getattr(self, flag)}")
        _check(self.max_step_timeout is None or self.max_step_timeout >= self.step_timeout,
               f"--max-step-timeout must be >= --step-timeout {self.step_timeout:g}, got {self.max_step_timeout}")
        _check(self.peak_tflops is None or self.peak_tflops > 0, f"--peak-tflops must be > 0, got {self.peak_tflops}")

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Gradient-accumulation steps per optimizer step; raises if the batch sizes don't fit."""
        gbs = self.resolved_global_batch_size(data_parallel_size)
        per_step = self.micro_batch_size * data_parallel_size
        if gbs % per_step:
            from megatron.common.cli import UserError

            raise UserError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {data_parallel_size}"
            )
        return gbs // per_step


@dataclasses.dataclass
class DataConfig:
    """Where tokens come from. With no ``data_path`` the embedded tiny-shakespeare corpus and its
    tokenizer are used (preprocessed on first use into ``data_cache_path``)."""

    data_path: Optional[list] = None
    """indexed dataset prefix (scripts/preprocess_data.py), or a weighted blend W1 P1 W2 P2; default: the
    embedded tiny-shakespeare corpus"""
    split: str = "969,30,1"
    """train,valid,test proportions of each dataset"""
    tokenizer_type: Optional[str] = None
    """HuggingFaceTokenizer, GPT2BPETokenizer or NullTokenizer; default: the embedded BPE"""
    tokenizer_model: Optional[str] = None
    """tokenizer.json (or its directory) of a HuggingFaceTokenizer"""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer vocabulary"""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer merges"""
    data_cache_path: Optional[str] = None
    """where dataset indices are cached; default: SAVE/data_cache"""
    num_workers: int = 0
    """data-loader worker processes per rank"""
    heldout_text: Optional[list] = None
    """text files scored for perplexity at the end of training (e.g. WikiText-2 test)"""


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """directory for checkpoints, metrics.jsonl and config.yaml; one run writes there at a time"""
    load: Optional[str] = None
    """resume from the newest checkpoint of this directory (or this iter_ directory); the same directory as
    --save resumes if it holds a checkpoint and starts from scratch if not; another directory without a
    checkpoint is an error (see --allow-empty-load)"""
    save_interval: Optional[int] = None
    """save a checkpoint every N steps (and always at the end)"""
    keep_last_checkpoints: Optional[int] = 2
    """keep only this run's newest N checkpoints (0 or unset: keep all); other runs' are never deleted"""
    no_load_optim: bool = False
    """load weights, iteration and data position but restart the optimizer"""
    no_load_rng: bool = False
    """do not restore the random-number generator states"""
    finetune: bool = False
    """load weights only: start at iteration 0 with a fresh optimizer and data order"""
    allow_empty_load: bool = False
    """a --load directory other than --save that holds no checkpoint starts the run from scratch (default:
    an error, so that a mistyped path never trains from random weights)"""
    load_fallback: bool = False
    """if the newest checkpoint under --load is incomplete or corrupt, report it and load the newest good
    one before it (the bad one is moved aside, never deleted, at the next save)"""
    overwrite_save: bool = False
    """let this run write into a --save directory that holds another run's checkpoints, deleting them (and
    their metrics.jsonl) at start-up"""
    verify_checkpoint: VerifyCheckpoint = VerifyCheckpoint.full
    """integrity check of checkpoints, at save (what the manifest records) and at load: full (sha256 of
    every file, hashed in parallel by all ranks), sizes (file sizes and the .metadata file's sha256), off"""
    async_save: bool = False
    """write checkpoints in a background thread from a CPU copy of the state while training goes on (at
    most one in flight; it is complete, and named iter_N, once the next save or the end of the run finishes
    it)"""

    def __post_init__(self):
        coerce_enums(self)
        _check(self.save_interval is None or self.save_interval >= 1,
               f"--save-interval must be >= 1, got {self.save_interval}")
        _check(self.keep_last_checkpoints is None or self.keep_last_checkpoints >= 0,
               f"--keep-last-checkpoints must be >= 0, got {self.keep_last_checkpoints}")


@dataclasses.dataclass
class LoggingConfig:
    log_interval: int = 10
    """print and record a step line every N steps"""
    eval_interval: int = 100
    """validate every N steps (0: only at the end)"""
    eval_iters: int = 10
    """validation batches per evaluation (0: no validation)"""
    metrics_file: Optional[str] = None
    """JSON-lines metrics file; default: SAVE/metrics.jsonl"""
    tensorboard_dir: Optional[str] = None
    """also write TensorBoard scalars here (needs the log extra)"""
    wandb_project: Optional[str] = None
    """also log to this Weights & Biases project (needs the log extra)"""
    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name"""
    wandb_mode: WandbMode = WandbMode.offline
    """Weights & Biases mode"""
    wandb_save_dir: Optional[str] = None
    """Weights & Biases local directory"""
    log_progress: bool = True
    """print the step lines"""
    print_config: bool = False
    """print the resolved configuration before training (it is always written to SAVE/config.yaml)"""

    def __post_init__(self):
        coerce_enums(self)
        _check(self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}")
        _check(self.eval_interval >= 0, f"--eval-interval must be >= 0, got {self.eval_interval}")
        _check(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
