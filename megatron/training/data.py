"""Training-time reading of indexed datasets: GPT datasets over them and batch iterators (writing
them is ``megatron.training.preprocess``).

* A run's data: ``check_data_paths`` (before any process group), ``build_data`` (the datasets and
  the resumable train iterator from the configs, the embedded corpus without ``--data-path``),
  ``eval_iterator``.
* Reading: ``build_pretraining_datasets`` builds (train, valid, test) ``GPTDataset``s (or
  ``BlendedDataset``s for weighted blends) through megatron-core's
  ``BlendedMegatronDatasetBuilder`` from Megatron-LM's ``--data-path`` and ``--split``.
  Under ``torch.distributed`` rank 0 builds and caches the sample indices, then the other ranks
  load them (megatron-core's own rank-0-first protocol); without it everything is built locally.
* Iterating: ``build_data_iterator`` yields micro-batches in a fixed order starting at any
  consumed-sample count (Megatron-LM's ``MegatronPretrainingSampler``), so a run resumed at step k
  sees exactly the batches the uninterrupted run saw after step k.
* Held-out text: ``build_heldout_windows`` cuts a text file into ``[N, seq_length + 1]`` windows.

megatron-core's sample-index builders are C++ (``megatron/core/datasets/helpers.cpp``). The
megatron-core wheels ship them compiled (``helpers_cpp.*.so``) and its sdist compiles them at
install time with pybind11, so nothing is compiled at run time; ``ensure_dataset_helpers`` checks
they import and says how to repair an install where they do not.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from megatron.common.cli import UserError
from megatron.training.preprocess import ensure_embedded_dataset, indexed_dataset_exists, indexed_dataset_paths

if TYPE_CHECKING:
    from megatron.components.arguments import Configs

__all__ = [
    "ensure_dataset_helpers",
    "check_data_paths",
    "build_data",
    "eval_iterator",
    "parse_data_path",
    "get_train_valid_test_num_samples",
    "build_pretraining_datasets",
    "PretrainingSampler",
    "build_data_iterator",
    "build_heldout_windows",
    "check_token_ids",
]

# --------------------------------------------------------------------------------------------
# C++ helpers
# --------------------------------------------------------------------------------------------
def ensure_dataset_helpers() -> None:
    """Check that megatron-core's compiled dataset helpers import (``helpers_cpp``).

    ``megatron.core.datasets.utils.compile_helpers()`` is Megatron-LM's source-checkout path (it
    runs ``make`` in a directory that the wheel does not ship a Makefile for), so it is not used.
    """
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "megatron-core's compiled dataset helpers (megatron.core.datasets.helpers_cpp) are "
            f"missing ({err}); reinstall megatron-core so that they are built: "
            "pip install --force-reinstall --no-deps megatron-core==0.16.1 (binary wheels ship "
            "them; a source build compiles helpers.cpp with pybind11 and a C++ compiler)"
        ) from None


# --------------------------------------------------------------------------------------------
# GPT datasets through BlendedMegatronDatasetBuilder
# --------------------------------------------------------------------------------------------
def parse_data_path(data_path: Union[str, Sequence[str]]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron-LM's ``--data-path``: ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns (prefixes, weights or None). A string is split on whitespace.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise UserError("--data-path is empty")

    def as_weight(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    numeric = [as_weight(s) is not None for s in items]
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = [as_weight(s) for s in items[0::2]]
        bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
        if bad:
            raise UserError(f"--data-path: blend weights must be positive numbers, got {bad[0]}")
        return items[1::2], weights
    if any(numeric):
        raise UserError(
            f"--data-path: expected 'PREFIX ...' or 'WEIGHT PREFIX WEIGHT PREFIX ...', got {' '.join(items)!r}"
        )
    return items, None


def _parse_split(split: str) -> list[float]:
    parts = [p.strip() for p in str(split).split(",")]
    try:
        vec = [float(p) for p in parts]
    except ValueError:
        vec = []
    if not 1 <= len(vec) <= 3 or any(not math.isfinite(v) or v < 0 for v in vec) or sum(vec) <= 0:
        raise UserError(f"--split: expected up to three non-negative weights like '969,30,1', got {split!r}")
    return vec + [0.0] * (3 - len(vec))


def get_train_valid_test_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> tuple[int, int, int]:
    """Samples each split must supply, as Megatron-LM computes them: train for every step,
    valid for every evaluation (one per ``eval_interval`` and one at the end), test once."""
    train = train_iters * global_batch_size
    evals = (train_iters // eval_interval + 1) if eval_interval > 0 else 1
    return train, evals * eval_iters * global_batch_size, eval_iters * global_batch_size


_SPLIT_NAMES = ("train", "valid", "test")


def build_pretraining_datasets(
    data_path: Union[str, Sequence[str]],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Sequence[Optional[int]],
    tokenizer,
    cache_dir: Optional[str] = None,
    *,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    create_attention_mask: bool = False,
) -> tuple:
    """(train, valid, test) datasets for ``GPTModel`` pretraining; a split is ``None`` when its
    ``--split`` weight is 0.

    Args:
        data_path: ``--data-path`` (see ``parse_data_path``). Prefixes given without weights are
            blended in proportion to their token counts (Megatron-LM would cap such a blend at
            one pass over the data, silently ignoring ``num_samples``).
        split: ``--split``, e.g. ``"969,30,1"``: contiguous document ranges of every prefix.
        seq_length: tokens per sample; each sample reads ``seq_length + 1`` tokens.
        seed: seed of the document and sample shuffles (same seed -> same order).
        num_samples: minimum samples per split (``get_train_valid_test_num_samples``). A single
            prefix gives whole epochs (``len >= num_samples``); a blend gives exactly the
            per-dataset ``ceil(num * weight)`` summed.
        tokenizer: from ``megatron.components.tokenizer.build_tokenizer`` (its ``eod``/``pad`` and
            identity enter the samples and the cache key).
        cache_dir: where the sample indices are cached (``--data-cache-path``); default
            ``<directory of the first prefix>/cache``. Must be shared by all ranks of a node.
        is_built_on_rank: megatron-core's hook; default every rank builds (and reads) its data.
        eod_mask_loss, reset_position_ids, reset_attention_mask: as Megatron-LM's flags.
        create_attention_mask: put ``attention_mask`` ([1, S, S] float, 1 = attend, the opposite
            of megatron-core's bool "True = masked" convention) in each sample.

    Items are dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and
    ``attention_mask``; blends add ``dataset_id``). Raises ``UserError`` naming ``--data-path``
    or ``--split`` for a missing prefix or a split that would have no documents; anything
    megatron-core's builder raises is not bad input and keeps its type.
    """
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    ensure_dataset_helpers()
    prefixes, weights = parse_data_path(data_path)
    split_vec = _parse_split(split)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must give (train, valid, test), got {list(num_samples)}")
    if seq_length < 1:
        raise UserError(f"--seq-length must be positive, got {seq_length}")
    token_counts = [_check_prefix(p, split_vec) for p in prefixes]
    if len(prefixes) > 1 and weights is None:
        weights = [float(n) for n in token_counts]
    if weights is not None and any(n is None for n, w in zip(num_samples, split_vec) if w > 0):
        raise ValueError("a weighted --data-path blend needs a sample count for every split")
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=",".join(np.format_float_positional(v, trim="-") for v in split_vec),
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    builder = _builder_class()(
        GPTDataset,
        [None if n is None else int(n) for n in num_samples],
        is_built_on_rank or (lambda: True),
        config,
    )
    return tuple(builder.build())


def _check_prefix(prefix: str, split_vec: Sequence[float]) -> int:
    """Validate one prefix against the split; return its token count."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import normalize

    if not indexed_dataset_exists(prefix):
        raise UserError(
            f"--data-path: no indexed dataset at {prefix} (needs {prefix}.bin and {prefix}.idx; "
            "make them with scripts/preprocess_data.py)"
        )
    index = IndexedDataset(prefix)
    lengths = np.array(index.sequence_lengths)  # a copy: the mmap closes with `index`
    del index
    # the document ranges megatron-core's builder will cut (blended_megatron_dataset_builder.py:443)
    matrix = convert_split_vector_to_split_matrix(normalize(list(split_vec)))
    for name, bookends in zip(_SPLIT_NAMES, matrix):
        if bookends is None:
            continue
        beg, end = (int(round(b * float(len(lengths)))) for b in bookends)
        if end <= beg or int(lengths[beg:end].sum()) == 0:
            raise UserError(
                f"--split {','.join(f'{v:g}' for v in split_vec)} leaves the {name} split of {prefix} "
                f"with no tokens ({len(lengths)} documents in all); give it a larger share, or 0"
            )
    return int(lengths.sum())


def check_token_ids(prefixes: Sequence[str], vocab_size: int, chunk: int = 1 << 24) -> None:
    """``UserError`` naming the dataset when a token id is ``>= vocab_size`` (a corpus tokenized
    with another tokenizer): otherwise the embedding lookup fails mid-step with a long traceback on
    one rank. Reads each ``.bin`` once, ``chunk`` tokens at a time."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        index = IndexedDataset(prefix)
        dtype = np.dtype(index.index.dtype)
        del index
        bin_path = indexed_dataset_paths(prefix)[0]
        if os.path.getsize(bin_path) == 0:
            continue
        tokens = np.memmap(bin_path, dtype=dtype, mode="r")
        top = 0
        for start in range(0, len(tokens), chunk):
            top = max(top, int(tokens[start:start + chunk].max()))
        del tokens
        if top >= vocab_size:
            raise UserError(
                f"--data-path {prefix}: holds token id {top}, but the tokenizer has {vocab_size} ids "
                "(was it preprocessed with another tokenizer or --vocab-size?)"
            )


_BUILDER_CLASS = None


def _builder_class():
    """``BlendedMegatronDatasetBuilder`` whose blends also work without ``torch.distributed``.

    megatron-core 0.16.1 ``blended_dataset.py:153`` calls ``torch.distributed.get_rank()`` on a
    blend-cache miss, which raises in a single process. There the blend indices (cheap and
    deterministic) are built in memory instead of cached; the GPT sample indices are still cached.
    """
    global _BUILDER_CLASS
    if _BUILDER_CLASS is None:
        from megatron.core.datasets.blended_dataset import BlendedDataset
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

        class LocalBlendedDataset(BlendedDataset):
            def __init__(self, datasets, weights, size, config):
                if not torch.distributed.is_initialized() and config.path_to_cache:
                    config = copy.copy(config)
                    config.path_to_cache = None
                super().__init__(datasets, weights, size, config)

        class Builder(BlendedMegatronDatasetBuilder):
            @staticmethod
            def build_generic_dataset(dataset_cls, is_built_on_rank, synchronize_ranks, *args):
                if dataset_cls is BlendedDataset:
                    dataset_cls = LocalBlendedDataset
                return BlendedMegatronDatasetBuilder.build_generic_dataset(
                    dataset_cls, is_built_on_rank, synchronize_ranks, *args
                )

        _BUILDER_CLASS = Builder
        logging.getLogger("megatron.core.datasets.blended_dataset").addFilter(_NoCacheNoticeFilter())
    return _BUILDER_CLASS


class _NoCacheNoticeFilter(logging.Filter):
    """Drop the "cannot save ... path_to_cache is None" warning for the single-process case above."""

    def filter(self, record):
        return "Cannot save the LocalBlendedDataset" not in record.getMessage()


# --------------------------------------------------------------------------------------------
# Iterators
# --------------------------------------------------------------------------------------------
class PretrainingSampler:
    """Batches of dataset indices in order, from ``consumed_samples`` on (Megatron-LM's
    ``MegatronPretrainingSampler``).

    Global sample ``g`` (counted over all data-parallel ranks) is index ``g`` of the dataset; each
    step takes the next ``micro_batch_size * data_parallel_size`` indices and rank ``r`` gets the
    ``r``-th slice of ``micro_batch_size``. Resuming with ``consumed_samples = k * global batch``
    therefore continues exactly where step k left off. The order is random because ``GPTDataset``
    shuffles its samples (seeded), not because of this sampler.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        drop_last: bool = True,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed samples {consumed_samples} outside the dataset's {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        step = self.micro_batch_size * self.data_parallel_size
        remaining = self.total_samples - self.consumed_samples
        return remaining // step if self.drop_last else -(-remaining // step)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        beg = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, step):
            batch = list(range(start, min(start + step, self.total_samples)))
            if len(batch) == step:
                yield batch[beg : beg + self.micro_batch_size]
            elif not self.drop_last:
                # the last partial step: spread what is left evenly (Megatron-LM does the same)
                per_rank = -(-len(batch) // self.data_parallel_size)
                part = batch[self.data_parallel_rank * per_rank : (self.data_parallel_rank + 1) * per_rank]
                if part:
                    yield part


def build_data_iterator(
    dataset,
    micro_batch_size: int,
    consumed_samples: int = 0,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    num_workers: int = 0,
    cyclic: bool = False,
) -> Iterator[dict]:
    """Iterator over collated micro-batches (dicts of ``[micro_batch_size, ...]`` tensors).

    Deterministic: batch ``j`` holds global samples ``consumed_samples + j * mbs * dp`` onwards
    (this rank's slice). ``cyclic`` restarts at ``consumed_samples`` when the data runs out (for
    validation); otherwise the iterator ends. ``num_workers > 0`` prefetches in worker processes
    without changing the order. Returns ``None`` for a ``None`` dataset (an empty split).
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    if len(sampler) == 0:
        raise UserError(
            f"the dataset has {len(dataset)} samples, fewer than one step of "
            f"{micro_batch_size} x {data_parallel_size} after {consumed_samples} consumed"
        )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        # page-locked host batches: the step's non_blocking copies to the GPU then overlap compute
        pin_memory=torch.cuda.is_available(),
        # its own generator: each iterator draws a base seed for its workers, which from the global
        # one would shift dropout masks between a run and its resume (built after the load)
        generator=torch.Generator().manual_seed(0),
    )
    if not cyclic:
        return iter(loader)

    def forever():
        while True:
            yield from loader

    return forever()


def build_heldout_windows(text_path: str, tokenizer, seq_length: int) -> torch.Tensor:
    """LongTensor ``[N, seq_length + 1]`` of a held-out text file, for perplexity.

    The whole file is tokenized as one text (no EOD added) and ``windows[i] =
    ids[i * S : i * S + S + 1]`` with ``S = seq_length``: inputs ``windows[:, :-1]``, labels
    ``windows[:, 1:]``. Consecutive windows share only their boundary token (the last label of
    one is the first input of the next), so the label sets do not overlap and every token after
    the first is scored exactly once; the tail shorter than a window is dropped.
    """
    if seq_length < 1:
        raise UserError(f"--seq-length must be positive, got {seq_length}")
    if not os.path.isfile(text_path):
        raise UserError(f"held-out text: no such file: {text_path}")
    with open(text_path, encoding="utf-8", newline="") as f:
        text = f.read()
    ids = torch.tensor(tokenizer.tokenize(text), dtype=torch.long)
    num_windows = (ids.numel() - 1) // seq_length
    if num_windows < 1:
        raise UserError(
            f"held-out text {text_path} has {ids.numel()} tokens, fewer than one window of {seq_length + 1}"
        )
    return ids.unfold(0, seq_length + 1, seq_length)[:num_windows].contiguous()


# --------------------------------------------------------------------------------------------
# A run's data from its configs
# --------------------------------------------------------------------------------------------
def check_data_paths(c: Configs) -> None:
    """Fail early (before any process group exists) when a ``--data-path`` prefix is missing."""
    if c.data.data_path is None:
        return
    prefixes, _ = parse_data_path(c.data.data_path)
    for prefix in prefixes:
        for path in indexed_dataset_paths(prefix):
            if not os.path.isfile(path):
                raise UserError(f"--data-path {prefix}: {path} does not exist (run scripts/preprocess_data.py)")
    for path in c.data.heldout_text or []:
        if not os.path.isfile(path):
            raise UserError(f"--heldout-text {path}: no such file")


def build_data(c: Configs, tokenizer, *, dp_rank: int, dp_size: int, consumed_samples: int, global_batch: int):
    """Train/valid/test datasets and the (resumable) train iterator."""
    cache = c.data.data_cache_path or os.path.join(c.checkpoint.save or ".", "data_cache")
    data_path = c.data.data_path
    if data_path is None:
        data_path = [ensure_embedded_dataset(cache)]
    num_samples = get_train_valid_test_num_samples(
        c.training.train_iters, global_batch, c.logging.eval_interval, c.logging.eval_iters
    )
    train_ds, valid_ds, test_ds = build_pretraining_datasets(
        data_path, c.data.split, c.model.seq_length, c.training.seed, num_samples, tokenizer, cache
    )
    train_iter = build_data_iterator(
        train_ds, c.training.micro_batch_size, consumed_samples, dp_rank, dp_size,
        num_workers=c.data.num_workers,
    )
    return train_ds, valid_ds, test_ds, train_iter


def eval_iterator(dataset, c: Configs, dp_rank: int, dp_size: int):
    """The iterator of an evaluation over ``dataset`` (None without one): from its first batch,
    cyclic."""
    if dataset is None:
        return None
    # every evaluation reads the same batches, so validation curves are comparable over time
    return build_data_iterator(dataset, c.training.micro_batch_size, 0, dp_rank, dp_size, cyclic=True)
