"""The ``--save`` directory at start-up: one writer at a time, and never another run's checkpoints.

``SaveDirLock`` is ``SAVE/writer.lock``: a POSIX record lock (``fcntl.lockf``) held by rank 0 for
the whole run, with the owner's pid, host and start time written in the file. The kernel drops the
lock when its process dies, however it dies, so a second run refuses to start while the first is
alive (naming its pid and host) and takes over a stale lock of a dead one with a log line. Record
locks are not inherited by forked children, so a helper process cannot keep a dead rank's lock.
(Across hosts this relies on the shared file system's lock support, as NFSv4 and Lustre provide.)

``prepare_save_dir`` runs under the lock before training starts and decides, from the manifests,
whether this run may write into the directory:

- leftover ``.tmp-iter_*`` directories of interrupted saves are reported and removed;
- ``iter_N`` directories without a manifest, and corrupt checkpoints newer than the one this run
  resumes from, are moved aside to ``iter_N.corrupt-<time>`` (never deleted);
- complete checkpoints this run does not descend from (a run that starts from scratch, fine-tunes,
  or resumes from another directory) are refused in one line naming the directory and the choices:
  ``--load`` it to resume, a new ``--save``, or ``--overwrite-save`` (which deletes them);
- complete checkpoints newer than the one resumed from would collide with this run's saves:
  refused the same way;
- older checkpoints of another lineage next to the resumed one are kept (never pruned);
- the latest pointer is rewritten to name the newest complete checkpoint left.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
from typing import Optional

from megatron.common.process import pid_alive

from megatron.components.checkpointing import (
    CheckpointError,
    config_differences,
    iteration_of,
    leftover_temporaries,
    move_aside,
    one_line_error,
    read_manifest,
    write_latest,
    read_manifest_quietly,
)

logger = logging.getLogger(__name__)

__all__ = ["LOCK_FILE", "SaveDirLock", "prepare_save_dir"]

LOCK_FILE = "writer.lock"


class SaveDirLock:
    """An exclusive writer lock on a save directory (see the module docstring)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.fd: Optional[int] = None
        self.took_over: Optional[dict] = None  # the stale owner replaced, if any

    def acquire(self) -> "SaveDirLock":
        """Take the lock or raise ``ValueError`` naming the live owner (or why the directory
        cannot be written)."""
        try:
            os.makedirs(self.save_dir, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EACCES, errno.EAGAIN):
                        os.close(fd)
                        raise
                    owner = _read_owner(fd)
                    os.close(fd)
                    raise ValueError(
                        f"--save {self.save_dir} is in use by another run ({_describe(owner)}; lock "
                        f"{self.path}): stop that run first, or use a new --save directory"
                    ) from None
                try:  # the file we locked may have been unlinked by its previous owner meanwhile
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            previous = _read_owner(fd)
            if previous and previous.get("pid") != os.getpid():
                self.took_over = previous
                logger.warning("%s: taking over the stale lock of %s (no longer running)", self.path,
                               _describe(previous))
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": datetime.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:
            raise ValueError(f"--save {self.save_dir}: cannot write there ({one_line_error(e)})") from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # drops the record lock
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_owner(fd: int) -> Optional[dict]:
    try:
        data = os.pread(fd, 4096, 0)
        owner = json.loads(data.decode() or "null")
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def _describe(owner: Optional[dict]) -> str:
    if not owner:
        return "owner unknown"
    host = owner.get("host", "?")
    state = ""
    if host == socket.gethostname() and isinstance(owner.get("pid"), int):
        state = "" if pid_alive(owner["pid"]) else ", not running"
    return f"pid {owner.get('pid', '?')} on {host}, since {owner.get('started', '?')}{state}"


def _listing(save_dir: str):
    """``[(iteration, path, manifest or None)]`` of the ``iter_N`` directories, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        iteration = iteration_of(name)
        path = os.path.join(save_dir, name)
        if iteration is not None and os.path.isdir(path):
            out.append((iteration, path, read_manifest_quietly(path)))
    return sorted(out)


def _names(items) -> str:
    names = [os.path.basename(p) for _, p, _ in items]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def prepare_save_dir(
    save_dir: str,
    *,
    resumed_from: Optional[str],
    start_iteration: int,
    lineage: str,
    configs: dict,
    overwrite: bool = False,
    run_files: tuple = (),
) -> list[str]:
    """Make ``save_dir`` safe for this run to write into, or raise ``ValueError`` (one line).

    ``resumed_from``: the checkpoint this run loaded when it continues that run (None for a run
    from scratch, a fine-tune, or a checkpoint of another directory); ``lineage``: this run's;
    ``configs``: its configs dict (to name what differs from another run's checkpoints);
    ``overwrite``: ``--overwrite-save``; ``run_files``: files of the previous run deleted with its
    checkpoints on overwrite (its metrics). Returns the log lines it printed (rank 0 calls it under
    ``SaveDirLock``).
    """
    lines = []

    def log(message, quiet=False):
        if not quiet:
            logger.warning(message)
        lines.append(message)

    try:
        for tmp in leftover_temporaries(save_dir):
            shutil.rmtree(tmp)
            log(f"removed {tmp}, left by an interrupted save")
        resumed = os.path.realpath(resumed_from) if resumed_from else None
        if resumed is not None and os.path.dirname(resumed) != os.path.realpath(save_dir):
            resumed = None  # resumed from another directory: this one holds nothing of ours yet
        conflicts, kept = [], []
        for iteration, path, manifest in _listing(save_dir):
            if manifest is None:
                target = move_aside(path, "incomplete (no manifest.json)")
                log(f"moved {path} aside to {os.path.basename(target)}: incomplete", quiet=True)
                continue
            if resumed is not None and os.path.realpath(path) == resumed:
                continue
            if resumed is not None and iteration <= start_iteration:
                if manifest.get("lineage") != lineage:
                    kept.append((iteration, path, manifest))
                continue
            if resumed is not None:  # newer than the checkpoint resumed from: corrupt, or a collision
                try:
                    read_manifest(path, verify=True)
                except CheckpointError as e:
                    target = move_aside(path, f"corrupt ({str(e).split(' is corrupt: ', 1)[-1]})")
                    log(f"moved {path} aside to {os.path.basename(target)}: corrupt", quiet=True)
                    continue
            conflicts.append((iteration, path, manifest))
        if conflicts and not overwrite:
            raise ValueError(_conflict_message(save_dir, conflicts, resumed_from if resumed else None, configs))
        for _, path, _ in conflicts:
            shutil.rmtree(path)
            log(f"--overwrite-save: deleted {path}")
        if conflicts and resumed is None:
            for name in run_files:
                if name and os.path.isfile(name):
                    os.unlink(name)
                    log(f"--overwrite-save: deleted {name}")
        if kept:
            log(f"{save_dir} also holds {_names(kept)} of another run: kept, never pruned by this run")
        complete = [it for it, path, manifest in _listing(save_dir) if manifest is not None]
        write_latest(save_dir, complete[-1] if complete else None)
    except OSError as e:
        raise ValueError(f"--save {save_dir}: {one_line_error(e)}") from None
    return lines


def _conflict_message(save_dir: str, conflicts: list, resumed_from: Optional[str], configs: dict) -> str:
    if resumed_from is not None:
        return (f"--save {save_dir} holds {_names(conflicts)}, newer than the checkpoint this run resumes "
                f"from ({os.path.basename(os.path.normpath(resumed_from))}): this run's saves would "
                "collide with them; pass --overwrite-save to replace them, or use a new --save directory")
    newest = conflicts[-1][2]
    differs = config_differences(newest.get("configs") or {}, configs, limit=3)
    which = (f"another run with a different configuration ({', '.join(differs)}; theirs vs this run's)"
             if differs else "another run")
    return (f"--save {save_dir} already holds checkpoints of {which}: {_names(conflicts)}; "
            f"pass --load {save_dir} to resume from them, a new --save directory, or --overwrite-save "
            "to replace them")
