"""Where the model-side commands run: one process, or ``torchrun`` ranks.

``profile`` and ``lar`` run a checkpoint at a TP/EP layout. The command validates its inputs in
the calling process (so bad input is a one-line error and nothing starts), then either runs in
that process (one rank: a gloo group on a private file store) or starts ``torchrun`` with the
same arguments and waits; under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the same command runs
the rank's share. Only rank 0 writes outputs, atomically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tools import repo_root

from .commands import COMMANDS

__all__ = ["in_torchrun", "run_under_torchrun", "ARGV_ENV", "rank_argv"]

# The command line travels to the ranks in this variable, not as torchrun script arguments:
# torchrun's own parser classifies every ``--option`` after the module name and rejects ours
# when they abbreviate one of its flags (``--nproc`` vs ``--nproc-per-node``).
ARGV_ENV = "SEMMOE_ARGV"


def in_torchrun() -> bool:
    """True inside a rank started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_argv() -> list[str] | None:
    """The command line handed to this torchrun rank by :func:`run_under_torchrun` (None if none)."""
    raw = os.environ.get(ARGV_ENV)
    return None if raw is None or not in_torchrun() else [str(a) for a in json.loads(raw)]


def run_under_torchrun(nproc: int, argv: list[str], env: dict | None = None) -> int:
    """Start ``torchrun --nproc_per_node=nproc -m tools.semmoe`` with ``argv`` and wait.

    Rank output streams through; when the ranks fail, the first ``python -m tools.semmoe: error:``
    line a rank printed (``run_cli``'s) is repeated last (one line), so a user error inside the
    ranks still reads as one line.
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    root = repo_root()
    full_env["PYTHONPATH"] = root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.update(env or {})
    full_env[ARGV_ENV] = json.dumps([str(a) for a in argv])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tools.semmoe"]  # fmt: skip
    proc = subprocess.run(cmd, env=full_env, stderr=subprocess.PIPE, text=True)
    if proc.returncode == 0:
        if proc.stderr:
            sys.stderr.write("".join(l + "\n" for l in proc.stderr.splitlines() if not _noise(l)))
        return 0
    lines = proc.stderr.splitlines()
    errors = [l for l in lines if l.startswith(f"{COMMANDS.prog}: error: ")]
    if errors:
        print(errors[0], file=sys.stderr)
        return 2
    sys.stderr.write("\n".join(_root_cause(lines)) + "\n")
    print(f"error: the {nproc} ranks failed (exit status {proc.returncode}); their output is above", file=sys.stderr)
    return 1


def _root_cause(lines: list[str], keep: int = 40) -> list[str]:
    """The traceback of the first rank that failed (torchrun prefixes it ``[rankN]:``), else the
    tail; the other ranks' SIGTERM reports and torchrun's summary would bury it."""
    for line in lines:
        if line.startswith("[rank") and "]:" in line:
            prefix = line[: line.index("]:") + 2]
            return [l for l in lines if l.startswith(prefix)][-keep:]
    return lines[-keep:]


def _noise(line: str) -> bool:
    """torchrun / megatron-core chatter on a successful run."""
    return ("UserWarning" in line or line.strip().startswith("warnings.warn") or "OMP_NUM_THREADS" in line
            or line.startswith("*****"))
