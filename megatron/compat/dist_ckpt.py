"""A ``torch_dist`` checkpoint save that writes in the calling process.

megatron-core 0.16.1's ``TorchDistSaveShardedStrategy`` writes through ``FileSystemWriterAsync``
even when saving synchronously: every save forks one writer process per file bucket
(``strategies/filesystem_async.py:266-303``), and their results travel through a queue owned by a
``multiprocessing.Manager`` server that is *spawned* once and lives as long as the rank
(``filesystem_async.py:51-56``, with its resource tracker). Under torchrun that costs two things:

- SIGTERM/SIGINT reach the rank's whole process group (torchrun starts each rank in its own
  session and signals it with ``killpg``), so the Manager dies and the save that preemption asked
  for fails with ``BrokenPipeError``;
- a rank killed with SIGKILL leaves the Manager (hundreds of MB: it re-imports the training
  module) and the resource tracker running, orphaned.

``InProcessTorchDistSaveStrategy`` keeps megatron-core's planning, file layout and metadata (a
checkpoint it writes is byte-for-byte the format ``dist_checkpointing.load`` reads) and replaces
only the execution: the write buckets are written one after another by the calling process, and
the results go through a plain in-process queue. No process is created, so nothing can be killed
under a save or outlive its rank. The checkpoint is as large and as fast to write on these CPU
runs; on a GPU cluster the loss is the parallelism of ``thread_count`` writer processes per rank.

``async_save`` returns megatron-core's ``AsyncRequest`` with the same in-process writer, for
``checkpointing.save_checkpoint(async_save=True)`` to run in a thread (its finalize functions, which
gather the write results and write ``.metadata``, stay collective calls of the training thread).
The writer is called without megatron-core's ``_disable_gc`` wrapper: that guards forked CUDA
children, and in a thread it would switch garbage collection off for the whole rank.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from pathlib import Path
from typing import Union

__all__ = ["InProcessTorchDistSaveStrategy", "in_process_save_strategy"]


@contextlib.contextmanager
def _in_process_results_queue():
    """Make ``FileSystemWriterAsync.prepare_write_data`` take a ``queue.Queue`` instead of
    spawning its Manager (it reads the module global ``_results_queue``, filesystem_async.py:185)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``write_preloaded_data_multiproc`` (filesystem_async.py:235) without the worker processes:
    the same per-bucket writer (``write_preloaded_data``), called in turn, same result protocol."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: Union[dict, Exception] = {}
    local_results, count = queue.Queue(), queue.Queue()
    write = FileSystemWriterAsync.write_preloaded_data
    write = getattr(write, "__wrapped__", write)  # without _disable_gc (see module doc)
    for index, bucket in enumerate(write_buckets):
        count.put(index)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        write(transform_list, index, bucket, local_results, count, True, **kwargs)
        local_index, outcome = local_results.get_nowait()
        if isinstance(outcome, Exception):
            results = outcome
            break
        results[local_index] = outcome
    global_results_queue.put(results)


def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """``torch_dist`` save whose file writes run in the calling process (see module doc)."""

        def async_save(self, sharded_state_dict, checkpoint_dir: Union[str, Path]):
            """megatron-core's request (planned, bytes items serialised) whose ``async_fn``
            writes in the calling process (or thread); args ``(rank, write_buckets, queue)``."""
            with _in_process_results_queue():
                request = super().async_save(sharded_state_dict, checkpoint_dir)
            fn = request.async_fn
            if fn is not None:
                # fn is partial(write_preloaded_data_multiproc, transform_list, use_msc)
                # (filesystem_async.py:205-209); keep its bound arguments, drop the processes
                if not (isinstance(fn, functools.partial) and len(fn.args) == 2):
                    raise RuntimeError("megatron-core's async save function changed shape; "
                                       "review megatron/compat/dist_ckpt.py")
                request = request._replace(async_fn=functools.partial(_write_buckets_in_process, *fn.args))
            return request

        def save(self, sharded_state_dict, checkpoint_dir: Union[str, Path]):
            self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    return InProcessTorchDistSaveStrategy


_CLASS = None


def in_process_save_strategy():
    """A fresh ``torch_dist`` (version 1) save strategy that writes in this process."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _strategy_class()
    return _CLASS("torch_dist", 1)


def __getattr__(name):  # the class itself, built lazily (megatron-core imports are heavy)
    if name == "InProcessTorchDistSaveStrategy":
        in_process_save_strategy()
        return _CLASS
    raise AttributeError(name)
