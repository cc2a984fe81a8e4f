"""Training metrics: one writer on one rank, several sinks (console, JSONL, TensorBoard, wandb).

The JSONL file is the machine-readable record of a run (one object per logged step, plus
``"event"`` records for evaluations and checkpoints); TensorBoard and wandb are optional and
imported only when asked for, with an install hint if missing.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Optional

__all__ = ["MetricsWriter", "peak_rss_mb", "step_record", "format_step_line", "format_duration"]


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} GB"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def step_record(step: int, m, rss_mb: float) -> dict:
    """The JSONL record of a logged step from ``step.train_step``'s metrics ``m`` and the peak RSS."""
    comm = m.comm
    return {
        "step": step,
        "loss": m.loss,
        "lm_loss": m.lm_loss,
        "aux_loss": m.aux_loss,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
        "tokens_per_sec": m.tokens_per_sec,
        "step_time_s": m.step_time_s,
        "fwd_time_s": m.fwd_time_s,
        "bwd_time_s": m.bwd_time_s,
        "optimizer_time_s": m.optimizer_time_s,
        "skipped": m.skipped,
        "a2a_bytes_dispatch": comm["bytes_dispatch"],
        "a2a_bytes_combine": comm["bytes_combine"],
        "a2a_bytes_meta": comm["bytes_meta"],
        "a2a_bytes_backward": comm["bytes_backward"],
        "a2a_time_s": comm["time_fwd_s"] + comm["time_bwd_s"],
        "exposed_comm_s": comm["exposed_fwd_s"] + comm["exposed_bwd_s"],
        "peak_rss_mb": rss_mb,
        **m.extra,
    }


def format_step_line(record: dict, train_iters: int, elapsed_s: Optional[float] = None,
                     eta_s: Optional[float] = None) -> str:
    """The one-line console summary of a logged step (with the run's elapsed time and ETA).

    The first loss column is what the step optimises, besides the MoE ``aux`` loss: ``loss`` (the
    next-token loss ``lm`` plus ``aux``) in pretraining; in distillation (the record has
    ``kd_loss``) ``kd``, the KL to the teacher, and ``l2``, the hidden-state term of ``kl+l2``,
    while ``lm``, the student's own next-token loss, is only watched and no ``loss`` is shown."""
    if "kd_loss" in record:
        losses = [f"kd {record['kd_loss']:.4f}", *([f"l2 {record['hidden_l2']:.4f}"] if "hidden_l2" in record else [])]
    else:
        losses = [f"loss {record['loss']:.4f}"]
    parts = [
        f"iter {record['step']:>6}/{train_iters}",
        *losses,
        f"lm {record['lm_loss']:.4f}",
        f"aux {record['aux_loss']:.4f}",
        f"lr {record['lr']:.2e}",
    ]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_sec']:.0f} tok/s")
    parts.append(f"{record['step_time_s']:.3f} s/step")
    a2a = record.get("a2a_bytes_dispatch", 0) + record.get("a2a_bytes_combine", 0)
    if a2a:
        parts.append(f"a2a {_fmt_bytes(a2a)} in {record.get('a2a_time_s', 0.0):.3f} s")
    if record.get("tflops_per_gpu") is not None:
        parts.append(f"{record['tflops_per_gpu']:.3g} TFLOP/s/GPU" + (f" MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""))
    if record.get("gpu_peak_mem_gb") is not None:
        parts.append(f"gpu mem {record['gpu_peak_mem_gb']:.1f} GiB")
    parts.append(f"rss {record['peak_rss_mb']:.0f} MB")
    if elapsed_s is not None:
        parts.append(f"elapsed {format_duration(elapsed_s)}" + (f" ETA {format_duration(eta_s)}" if eta_s is not None else ""))
    return " | ".join(parts)


class MetricsWriter:
    """Writes metrics from the logging rank only; every other rank gets a no-op writer."""

    def __init__(
        self,
        *,
        enabled: bool,
        jsonl_path: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        wandb_project: Optional[str] = None,
        wandb_exp_name: Optional[str] = None,
        wandb_mode: str = "offline",
        wandb_save_dir: Optional[str] = None,
        config: Optional[dict] = None,
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "--tensorboard-dir needs tensorboard: pip install -e '.[log]'"
                ) from None
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("--wandb-project needs wandb: pip install -e '.[log]'") from None
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=wandb_project,
                name=wandb_exp_name,
                mode=wandb_mode,
                dir=wandb_save_dir,
                config=config or {},
            )

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        numeric = {
            k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"
        }
        if self._tb:
            for key, value in numeric.items():
                self._tb.add_scalar(f"train/{key}", value, step)
        if self._wandb:
            self._wandb.log({f"train/{k}": v for k, v in numeric.items()}, step=step)

    def log_event(self, kind: str, step: int, **fields) -> None:
        if not self.enabled:
            return
        record = {"event": kind, "step": step, "time": time.time(), **fields}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in fields.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb:
            for key, value in numeric.items():
                self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._wandb:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
