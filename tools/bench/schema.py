"""What the benchmark launcher hands a worker, and what each worker rank hands back.

Both sides of the harness share these dataclasses: the launcher writes a :class:`WorkerSpec` as
JSON and starts ``python -m <worker module> <spec.json>`` once per rank (rank, world size and
rendezvous come from the environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``); every rank writes one :class:`RankResult` to
``spec.result_path(rank)``.

Per-step lists have one entry per *measured* step (warm-up steps are not recorded), so
``len(step_time_s) == spec.steps``. Units: seconds, bytes, tokens, MiB (``peak_rss_mb``).

Field meanings (all per rank, per step):

* ``step_time_s``      wall time of the whole training step (forward, backward, optimizer).
* ``fwd_time_s``       wall time of the forward pass; ``bwd_time_s`` of the backward pass.
* ``a2a_time_s``       wall time with at least one expert-parallel all-to-all in flight (launch to
                       completion), forward plus backward: collectives in flight together count once.
                       Overlapped all-to-alls count in full even when hidden behind compute, so this
                       can exceed what the step actually waited.
* ``exposed_comm_s``   time the compute thread spent blocked waiting on those all-to-alls.
* ``a2a_bytes_dispatch`` / ``a2a_bytes_combine``  bytes of the forward dispatch / combine
                       all-to-alls that left this rank (rows addressed to other ranks), summed over
                       MoE layers. ``a2a_bytes_backward`` (optional): the backward all-to-alls.
* ``tokens``           tokens this rank processed in the step (its micro-batches x sequence).
* ``peak_rss_mb``      peak resident set size of the rank process (scalar, whole run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from megatron.common.cli import UserError
from megatron.common.files import write_json

__all__ = [
    "SCHEMA_VERSION",
    "STEP_FIELDS",
    "SyntheticOptions",
    "WorkerSpec",
    "RankResult",
    "peak_rss_mb",
]

SCHEMA_VERSION = 1

STEP_FIELDS = (
    "step_time_s",
    "fwd_time_s",
    "bwd_time_s",
    "a2a_time_s",
    "exposed_comm_s",
    "a2a_bytes_dispatch",
    "a2a_bytes_combine",
    "tokens",
)


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (``ru_maxrss`` is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclasses.dataclass
class SyntheticOptions:
    """Sizes of the synthetic worker (``--variants synthetic``), an EP-shaped test load.

    Per layer and step each rank routes ``tokens x topk`` rows of ``hidden`` fp32 values evenly
    to all ranks (dispatch all-to-all), runs a 2-matmul expert MLP (``hidden -> ffn -> hidden``)
    on what it received, and sends the rows back (combine); backward mirrors both all-to-alls.
    """

    tokens: int = 512
    hidden: int = 256
    ffn: int = 1024
    topk: int = 2
    layers: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"--synthetic-{f.name} must be a positive integer, got {v!r}")


@dataclasses.dataclass
class WorkerSpec:
    """One benchmark job, identical for every rank of a launch.

    ``variant`` names the MoE variant (``standard``, ``bigmac``, ... for the model worker;
    ``synthetic`` for the synthetic worker; ``collectives`` for calibration). ``config_path`` is
    the model YAML and ``overrides`` are model-config fields set on top of it (flag names with
    ``-`` -> ``_``). ``options`` carries worker-specific settings (the synthetic sizes, the
    calibration sweep). Every rank writes its result to ``result_path(rank)``.
    """

    variant: str
    output_dir: str
    warmup: int = 1
    steps: int = 5
    seed: int = 1234
    config_path: Optional[str] = None
    overrides: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    num_threads: int = 1
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if not self.variant:
            raise UserError("--variants: empty variant name")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")
        if self.steps < 1:
            raise UserError(f"--steps must be >= 1, got {self.steps}")
        if self.num_threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.num_threads}")

    def result_path(self, rank: int) -> str:
        return os.path.join(self.output_dir, f"rank{rank}.json")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, path: str) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"worker spec: unknown keys {unknown}")
        if d.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ValueError(f"worker spec: schema_version {d['schema_version']} != {SCHEMA_VERSION}")
        return cls(**d)

    @classmethod
    def read(cls, path: str) -> "WorkerSpec":
        with open(path) as f:
            return cls.from_dict(json.load(f))


@dataclasses.dataclass
class RankResult:
    """One rank's measurements of one launch (see the module docstring for the fields)."""

    rank: int
    world_size: int
    variant: str
    step_time_s: list
    fwd_time_s: list
    bwd_time_s: list
    a2a_time_s: list
    exposed_comm_s: list
    a2a_bytes_dispatch: list
    a2a_bytes_combine: list
    tokens: list
    peak_rss_mb: float
    a2a_bytes_backward: Optional[list] = None
    extra: dict = dataclasses.field(default_factory=dict)  # worker-specific (loss, config echo)
    schema_version: int = SCHEMA_VERSION

    def validate(self, steps: Optional[int] = None) -> None:
        """Raise ``ValueError`` naming the first field that breaks the schema."""
        n = len(self.step_time_s)
        if steps is not None and n != steps:
            raise ValueError(f"rank {self.rank}: {n} measured steps recorded, expected {steps}")
        fields = list(STEP_FIELDS) + (["a2a_bytes_backward"] if self.a2a_bytes_backward is not None else [])
        for name in fields:
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"rank {self.rank}: {name} must be a list of {n} values")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"rank {self.rank}: {name} has a bad value {v!r}")
            if name.startswith("a2a_bytes") or name == "tokens":
                if any(int(v) != v for v in values):
                    raise ValueError(f"rank {self.rank}: {name} must hold integers")
        if not (self.peak_rss_mb > 0):
            raise ValueError(f"rank {self.rank}: peak_rss_mb must be > 0")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, path: str) -> None:
        self.validate()
        write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "RankResult":
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)  # fmt: skip
        if missing:
            raise ValueError(f"rank result: missing keys {missing}")
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"rank result: unknown keys {unknown}")
        return cls(**d)

    @classmethod
    def read(cls, path: str) -> "RankResult":
        with open(path) as f:
            return cls.from_dict(json.load(f))
