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

``start_save`` plans a save and returns megatron-core's ``AsyncRequest`` with the same in-process
writer, which ``checkpointing`` runs in the calling thread or (``async_save``) in another, and a
``SaveFinalize`` that ends it. The writer is called without megatron-core's ``_disable_gc`` wrapper:
that guards forked CUDA children, and in a thread it would switch garbage collection off for the
whole rank.

``SaveFinalize`` replaces megatron-core's two finalize functions, which a failure on rank 0 turns
into a hang: ``save_state_dict_async_finalize`` (``state_dict_saver.py:213``) has rank 0 write
``.metadata`` between a gather and a broadcast of the failure flag, and ``dist_checkpointing.save``'s
``metadata_finalize_fn`` (``serialization.py:420``) has it write ``metadata.json`` before a barrier;
an exception in either write skips rank 0's broadcast or barrier, and the other ranks wait in it
until a timeout. ``SaveFinalize`` splits the same work where one rank can fail alone: ``gather``
(every rank's write results to rank 0) is the collective, and ``write`` (rank 0's two files) has
no collective after it, so the caller agrees on its outcome before any rank waits.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from pathlib import Path
from typing import Optional, Union

__all__ = ["InProcessTorchDistSaveStrategy", "in_process_save_strategy", "start_save", "SaveFinalize"]


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


class SaveFinalize:
    """The end of an in-process save, once every rank's writer is done: ``gather`` on every rank
    (collective), then ``write`` on rank 0 with the gathered results (no collective; see the
    module doc)."""

    def __init__(self, storage_writer, global_metadata, dist_wrapper, config):
        self._storage_writer = storage_writer
        self._global_metadata = global_metadata  # None except on rank 0
        self._dist_wrapper = dist_wrapper
        self._config = config  # megatron-core's CheckpointingConfig, metadata.json's content

    def gather(self) -> Optional[list]:
        """Every rank's write results, on rank 0 (None elsewhere); collective."""
        return self._dist_wrapper.gather_object(self._storage_writer.retrieve_write_results())

    def write(self, all_results: list) -> None:
        """Rank 0: raise the first failed rank's write error (torch's ``CheckpointException``), else
        write ``.metadata`` (the storage writer's ``finish``) and ``metadata.json``."""
        from megatron.core.dist_checkpointing.core import save_config
        from torch.distributed.checkpoint import CheckpointException
        from torch.distributed.checkpoint.utils import _get_failure_dict

        failures = _get_failure_dict(all_results)
        if failures:
            raise CheckpointException("write", failures)
        self._storage_writer.finish(self._global_metadata, all_results)
        save_config(self._config, self._storage_writer.checkpoint_dir)


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

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            """megatron-core's request (torch.py:737) with a ``SaveFinalize`` for its finalize function."""
            from megatron.core.dist_checkpointing.core import CheckpointingConfig

            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            finalize = SaveFinalize(*save_state_dict_ret, CheckpointingConfig(self.backend, self.version))
            return request._replace(finalize_fns=[finalize])

        def save(self, sharded_state_dict, checkpoint_dir: Union[str, Path]):
            raise NotImplementedError("an in-process save is started with start_save and ended with its "
                                      "SaveFinalize, whose outcome the caller agrees on across ranks")

    return InProcessTorchDistSaveStrategy


_CLASS = None


def in_process_save_strategy():
    """A fresh ``torch_dist`` (version 1) save strategy that writes in this process."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _strategy_class()
    return _CLASS("torch_dist", 1)


def start_save(sharded_state_dict, checkpoint_dir: str):
    """Plan a ``torch_dist`` save of ``sharded_state_dict`` into ``checkpoint_dir`` (``common.pt`` is
    written now). Returns ``(request, finalize)``: ``request.async_fn(*request.async_fn_args)``
    writes this rank's shards (args ``(rank, write_buckets, results queue)``; ``None``: nothing to
    write), then every rank calls ``finalize.gather()`` and rank 0 ``finalize.write(results)``. The
    request has no finalize functions left: ``finalize`` does what megatron-core's did."""
    from megatron.core import dist_checkpointing

    request = dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=in_process_save_strategy(),
                                      async_sharded_save=True)
    # [ours, metadata_finalize_fn] (serialization.py:437-438); ours writes metadata.json too
    fns = request.finalize_fns
    if len(fns) != 2 or not isinstance(fns[0], SaveFinalize):
        raise RuntimeError("megatron-core's save finalize functions changed shape; review megatron/compat/dist_ckpt.py")
    return request._replace(finalize_fns=[]), fns[0]


def __getattr__(name):  # the class itself, built lazily (megatron-core imports are heavy)
    if name == "InProcessTorchDistSaveStrategy":
        in_process_save_strategy()
        return _CLASS
    raise AttributeError(name)
