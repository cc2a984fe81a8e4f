"""One variant's server ranks in the benchmark's network, the load client run against it, and the
link-rate search on it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import signal
import time
from typing import Optional

from tools.bench import netns
from tools.bench.cli import Budget
from tools.bench.launcher import LaunchError, start_ranks
from tools.bench.tune import find_rate

from . import analysis
from .client import ClientSpec
from .resume import spans_of

__all__ = ["Server", "tune", "SERVE_MODULE", "CLIENT_MODULE"]

log = logging.getLogger("bench_serve")

SERVE_MODULE = "megatron.inference.serve"
CLIENT_MODULE = "tools.serve_bench.client"
STARTUP_TIMEOUT_S = 900.0
SHUTDOWN_TIMEOUT_S = 30.0


def engine_settings(args) -> dict:
    """The engine's batch limits the servers run with (a prefill burst: its tokens in one step)."""
    if args.mode == "prefill":
        max_batch = args.prefill_tokens
        max_requests = math.ceil(args.prefill_tokens / args.input_len) + 1
    else:
        max_batch, max_requests = args.max_batch_tokens, args.max_requests
    return {"max_batch_tokens": max_batch, "max_requests": max_requests, "kv_cache_gb": args.kv_cache_gb}


class Server:
    """One variant's server ranks in the network (a context manager: SIGTERM, drain, exit)."""

    def __init__(self, net, args, ckpt: str, preset: Optional[str], run_dir: str, budget: Budget, printer,
                 label: str, placement=None):
        self.net, self.args, self.run_dir, self.budget, self.printer, self.label = \
            net, args, run_dir, budget, printer, label
        self.ready_file = os.path.join(run_dir, "ready.json")
        self.spans_dir = os.path.join(run_dir, "a2a_spans")  # each rank's engine steps' all-to-alls
        self.engine = engine_settings(args)
        self.argv = ["-m", SERVE_MODULE, "--load", os.path.abspath(ckpt), "--expert-model-parallel-size",
                     str(args.serve_ep), "--tensor-model-parallel-size",
                     str(args.tensor_model_parallel_size), "--host", "127.0.0.1", "--port", "0", "--ready-file", self.ready_file,
                     "--max-batch-tokens", str(self.engine["max_batch_tokens"]), "--max-requests", str(self.engine["max_requests"]),
                     "--kv-cache-gb", str(args.kv_cache_gb), "--seed", str(args.seed),
                     "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--a2a-spans", self.spans_dir]
        # LAR is defined for attention-DP, and for attention-TP where the placement's server re-batches
        # tokens (Sem-MoE's Algorithm 3)
        if args.routing_stats and (args.tensor_model_parallel_size == 1
                                   or (placement is not None and placement.routing_stats_at_tp)):
            self.argv.append("--routing-stats")
        if args.expert_comm != "alltoall":
            self.argv += ["--expert-comm", args.expert_comm]
        if preset:
            self.argv += ["--variant", preset]
        if placement is not None:
            self.argv += list(placement.server_arguments)
        self.ranks = None
        self.url = None
        self._tags = itertools.count()
        self.last_result = None  # the last client's result file

    def __enter__(self) -> "Server":
        shutil.rmtree(self.run_dir, ignore_errors=True)  # a kept --work-dir holds the last run's ready file
        os.makedirs(self.run_dir)
        self.ranks = start_ranks(self.net, self.argv, self.run_dir, num_threads=self.args.threads,
                                 log_prefix="server")
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            t0 = time.monotonic()
            while not os.path.exists(self.ready_file):
                self.ranks.check()
                self.budget.remaining()
                if time.monotonic() > deadline:
                    raise LaunchError(f"the server did not start in {STARTUP_TIMEOUT_S:.0f}s\n"
                                      f"{self.ranks.log_tail(0)}")
                self.printer.progress(f"[{self.label}] starting {self.net.num_ranks} server ranks "
                                      f"({time.monotonic() - t0:.0f}s)")
                time.sleep(0.2)
            with open(self.ready_file) as f:
                self.url = json.load(f)["url"]
        except BaseException:
            self.ranks.kill()
            raise
        self.printer.line(f"[{self.label}] serving on {self.url} inside rank 0's "
                          f"{'namespace' if self.net.shaped else 'host'} ({time.monotonic() - t0:.0f}s to start)")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.ranks.kill()
            return
        self.ranks.signal(signal.SIGTERM)
        try:
            self.ranks.wait(SHUTDOWN_TIMEOUT_S + 30)
        except LaunchError as err:
            log.warning("[%s] the server did not stop cleanly: %s", self.label, str(err).splitlines()[0])
        finally:
            self.ranks.kill()

    def spans(self) -> list:
        """Every rank's step lines (``serve --a2a-spans``; read once the servers stopped), or [] when
        no rank recorded an all-to-all (one expert-parallel rank)."""
        return spans_of(self.spans_dir, self.net.num_ranks)

    def run(self, phases: dict, what: str) -> dict:
        """Run the load client on ``phases`` (name -> requests) in rank 0's namespace; its result."""
        tag = f"client{next(self._tags)}"
        spec = ClientSpec(url=self.url, phases=[{"name": n, "requests": r} for n, r in phases.items()],
                          result_path=os.path.join(self.run_dir, f"{tag}-result.json"),
                          progress_path=os.path.join(self.run_dir, f"{tag}-progress.json"))
        spec_path = os.path.join(self.run_dir, f"{tag}-spec.json")
        spec.write(spec_path)
        with start_ranks(self.net, ["-m", CLIENT_MODULE, spec_path], self.run_dir,
                         endpoints=[self.net.endpoints[0]], log_prefix=f"{tag}-") as client:
            while client.running():
                self.ranks.check()
                self.budget.remaining()
                self._show(spec.progress_path, what)
                time.sleep(0.5)
            client.wait(10.0)
        self._show(spec.progress_path, what, force=True)
        self.printer.clear()
        self.last_result = spec.result_path
        with open(spec.result_path) as f:
            return {p["name"]: p for p in json.load(f)["phases"]}

    def _show(self, path: str, what: str, force: bool = False) -> None:
        try:
            with open(path) as f:
                s = json.load(f)
        except (OSError, ValueError):
            return
        self.printer.progress(f"[{self.label}] {what} {s.get('phase')}: {s['sent']}/{s['total']} sent, "
                              f"{s['done']} done, {s['failed']} failed, {s.get('elapsed_s', 0):.0f}s", force)


def tune(server: Server, net, args, work, printer) -> dict:
    link = netns.LinkSpec(args.link_gbit, 0.0, args.shaper)

    def measure(gbit: float) -> float:
        net.set_link(dataclasses.replace(link, gbit=gbit))
        phases = server.run({f"probe-{k}": p for k, p in enumerate(work["probes"])}, f"probe {gbit:.4g} Gbit/s")
        return analysis.probe_fraction(list(phases.values()))

    result = find_rate(measure, args.target_comm_fraction, start=args.link_gbit, tol=args.fraction_tol,
                       max_probes=args.max_probes, log=printer.line)
    tuning = result.as_dict()
    tuning["probe_variant"] = server.label
    tuning["fraction_basis"] = ("engine all-to-all in flight, median / (median + fastest compute) over ranks x "
                                f"{args.probe_rounds} calibration bursts; compute = busy - exposed")
    if not result.converged:
        log.warning("rate search did not converge: %s; using the closest probe", result.message)
    net.set_link(dataclasses.replace(link, gbit=result.gbit))
    printer.line(f"link set to {result.gbit:.4g} Gbit/s (probe all-to-all share at the fastest compute "
                 f"{result.fraction:.3f})")
    return tuning
