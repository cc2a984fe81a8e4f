"""``python -m tools.faults serving-chaos OUT --load CKPT [--faults 8] [--minutes 5] [--rate 2]``:
random faults in a serving engine under client load, against a fault-free run of the same load.

The server runs as users run it with restarts, the README's command: ``serve --nproc-per-node 2
--max-restarts K --expert-model-parallel-size 2 --port 8000`` (``--port``; the front end in its own
process, torchrun's ranks as its child; started as ``tools.faults.rank serve`` so that each rank
takes in-rank faults), on 127.0.0.1. The load: ShareGPT first turns
(``--prompts``) cut to the model's context, Poisson arrivals at ``--rate`` for ``--minutes``, a
seeded ``--stream-fraction`` of them streamed, greedy with ``ignore_eos`` (the answer's length,
at most ``--max-output-len`` tokens) and ``return_token_ids``; no client retries. The load runs
twice with the same seed: fault-free (the baseline), then while ``--faults`` faults hit random
ranks (every kind of ``--kinds`` once per round, in a random order), one at a time, each
``--gap`` seconds (uniform) after the server answered again: kill -9 and SIGSTOP from outside, a
segfault and an exception in the forward from inside (``tools.faults.inject``: at the rank's next
engine step). A poller reads ``/health`` every 0.1 s.

Per fault: **detected**, the seconds from the fault to ``/health`` not 200; **back**, to
``/health`` 200 again (the ranks restarted); the requests it cut: a **clean error** (a status with
its JSON error, or a stream's error event and then ``[DONE]``), a **hang** (no byte for
``--client-timeout`` s, far above every bound), **broken** (the connection cut without an answer).
Overall: the requests served against the baseline's, and every served request's tokens against the
baseline's (greedy: equal, or the run fails); the engine requests the front end held across a
restart and sent again (``resubmitted``, from its ``/metrics``: requests in flight at a fault that
had sent their client nothing yet; those that arrived during an outage wait the same way). Prints a
table per fault kind and writes ``OUT/serving_chaos.json`` (schema ``serving_chaos/1``; its
``requests`` are the raw per-request records, which ``python -m tools.figure_summary`` leaves out of
a committed copy). Exit 0 when every fault was detected and the server came back, no client hung or was cut off, no request failed
before the first fault, and no served token differs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

from megatron.common.files import write_json
from tools.faults import inject
from tools.faults.launch import REPO, rank_pid, read

__all__ = ["KINDS", "ChaosConfig", "build_requests", "complete", "resubmitted", "serving_chaos", "summarize"]

EXTERNAL = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
KINDS = ("sigkill", "sigstop", "segfault", "error")
OUTCOMES = ("ok", "error", "hang", "broken")
NPROC = 2


@dataclasses.dataclass
class ChaosConfig:
    out: str
    load: str
    prompts: str
    faults: int = 8
    minutes: float = 5.0
    rate: float = 2.0
    kinds: tuple = KINDS
    seed: int = 0
    max_output_len: int = 32
    stream_fraction: float = 0.5
    gap: tuple = (5.0, 15.0)  # seconds of service between the server answering again and the next fault
    stall_timeout: float = 2.0
    watchdog_timeout: float = 10.0
    client_timeout: float = 120.0
    port: int = 8000  # the documented command's fixed port (0: any free one)
    recovery_timeout: float = 300.0  # seconds a fault may take to be detected and recovered from
    skip_baseline: bool = False


def build_requests(cfg: ChaosConfig, tokenize, context: int) -> list:
    """The load of a run: ``[{i, at, prompt, max_tokens, stream}]``, a function of the seed."""
    from tools.serve_bench.loadgen import load_prompt_pairs
    from tools.serve_bench.workload import arrivals_for, from_prompts

    arrivals = arrivals_for(cfg.rate, cfg.seed, duration_s=cfg.minutes * 60)
    reqs, _ = from_prompts(load_prompt_pairs(cfg.prompts), tokenize, num=len(arrivals), context=context,
                           seed=cfg.seed, max_output_len=cfg.max_output_len)
    rng = random.Random(cfg.seed + 1)
    return [{"i": i, "at": t, "prompt": list(r.prompt), "max_tokens": r.max_tokens,
             "stream": rng.random() < cfg.stream_fraction} for i, (t, r) in enumerate(zip(arrivals, reqs))]


def complete(url: str, req: dict, timeout: float, started: Optional[threading.Event] = None) -> dict:
    """Send one request (greedy unless ``req["sampling"]`` gives other fields), classify its answer
    (``OUTCOMES``): ``{i, sent, done, status, outcome, tokens, message}``, times in epoch seconds.
    ``started`` is set once a stream's first event has arrived."""
    body = json.dumps({"prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True, "stream": req["stream"],
                       **req.get("sampling", {})})
    out = {"i": req["i"], "stream": req["stream"], "sent": time.time(), "done": None, "status": None,
           "outcome": "broken", "tokens": None, "message": ""}
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["message"] = json.loads(resp.read())["error"]["message"]
            out["outcome"] = "error"
        elif not req["stream"]:
            out["tokens"] = json.loads(resp.read())["choices"][0]["token_ids"]
            out["outcome"] = "ok"
        else:
            tokens = []
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["outcome"] = "error" if out["message"] else "ok"
                    out["tokens"] = tokens
                    break
                chunk = json.loads(payload)
                if started is not None:
                    started.set()
                if "error" in chunk:
                    out["message"] = chunk["error"]["message"]
                for choice in chunk.get("choices") or []:
                    tokens += choice.get("token_ids") or []
            else:
                out["message"] = "the stream ended without [DONE]"
    except TimeoutError:
        out["outcome"], out["message"] = "hang", f"no byte for {timeout:g} s"
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as err:
        out["outcome"], out["message"] = "broken", f"{type(err).__name__}: {err}"
    finally:
        out["done"] = time.time()
        conn.close()
    return out


def _run_load(url: str, requests: list, timeout: float, start: float) -> list:
    """Every request at ``start + at`` (epoch); their outcomes in order."""
    results: list = [None] * len(requests)
    with concurrent.futures.ThreadPoolExecutor(max_workers=256) as pool:
        futures = []
        for req in requests:
            time.sleep(max(0.0, start + req["at"] - time.time()))
            futures.append(pool.submit(complete, url, req, timeout))
        for future in futures:
            r = future.result()
            results[r["i"]] = r
    return results


class HealthLog(threading.Thread):
    """``/health`` every ``interval_s``: ``samples`` of (epoch of the answer, HTTP status or
    None, its status, its reason)."""

    def __init__(self, url: str, interval_s: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.samples: list = []
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            asked = time.time()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    code, body = resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as err:
                code, body = err.code, json.loads(err.read() or b"{}")
            except (OSError, ValueError):
                code, body = None, {}
            self.samples.append((time.time(), code, body.get("status"), body.get("reason")))
            self._halt.wait(max(0.0, self.interval_s - (time.time() - asked)))

    def stop(self):
        self._halt.set()
        self.join(5)

    def wait_for(self, ok: bool, after: float, timeout: float) -> Optional[tuple]:
        """The first sample after ``after`` whose status is (``ok``) or is not 200, waiting up to
        ``timeout`` seconds for it."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for sample in self.samples:
                if sample[0] >= after and (sample[1] == 200) == ok:
                    return sample
            time.sleep(0.05)
        return None


class ServerRun:
    """``python -m tools.faults.rank serve --nproc-per-node 2 ...`` with its log and ready file in
    ``out/<name>.*``, its own session (``stop`` ends every process of it)."""

    def __init__(self, cfg: ChaosConfig, name: str, fault_dir: str):
        self.log = os.path.join(cfg.out, f"{name}.log")
        ready = os.path.join(cfg.out, f"{name}.ready.json")
        if os.path.exists(ready):
            os.remove(ready)
        cmd = [sys.executable, "-m", "tools.faults.rank", "serve", "--nproc-per-node", str(NPROC),
               "--max-restarts", str(cfg.faults + 2), "--load", cfg.load, "--expert-model-parallel-size", str(NPROC),
               "--port", str(cfg.port), "--ready-file", ready, "--stall-timeout", str(cfg.stall_timeout),
               "--watchdog-timeout", str(cfg.watchdog_timeout), "--seed", str(cfg.seed)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO,
                                                  **{inject.ENV: fault_dir}))
        deadline = time.time() + 600
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; see {self.log}")
            time.sleep(0.2)
        with open(ready) as f:
            self.info = json.load(f)
        self.url = self.info["url"]

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _inject_faults(cfg: ChaosConfig, server: ServerRun, health: HealthLog, fault_dir: str, load_end: float) -> list:
    """The faults, one at a time, each after the server answered again (module docstring)."""
    rng = random.Random(cfg.seed + 2)
    kinds = []
    while len(kinds) < cfg.faults:  # every kind once in each round, in a random order
        kinds += rng.sample(cfg.kinds, len(cfg.kinds))
    faults = []
    for n in range(cfg.faults):
        time.sleep(rng.uniform(*cfg.gap))
        if time.time() > load_end - cfg.gap[0]:  # inside the load, with time left to see it
            break
        kind, rank = kinds[n], rng.randrange(NPROC)
        fault = {"n": n + 1, "kind": kind, "rank": rank, "requested": time.time(), "at": None}
        if kind in EXTERNAL:
            os.kill(rank_pid(server.proc.pid, rank, timeout=30), EXTERNAL[kind])
            fault["at"] = time.time()
        else:
            inject.request(fault_dir, rank, kind)
        print(f"serving-chaos: fault {n + 1}/{cfg.faults}: {kind} on rank {rank}", flush=True)
        down = health.wait_for(False, fault["requested"], cfg.recovery_timeout)
        up = health.wait_for(True, down[0], cfg.recovery_timeout) if down else None
        fault["down"] = down[0] if down else None
        fault["health"] = {"status": down[2], "reason": down[3]} if down else None
        fault["up"] = up[0] if up else None
        faults.append(fault)
        if up is None:
            print(f"serving-chaos: the server did not come back after fault {n + 1}", flush=True)
            break
    return faults


def _fault_times(log_text: str, faults: list) -> None:
    """The instant of each in-rank fault, from the injecting rank's line in the server log."""
    taken = [(int(m[1]), m[2], float(m[3])) for m in
             re.finditer(r"\[rank (\d+)\] injecting fault '(\w+)' after step \d+ at ([\d.]+)", log_text)]
    for fault in faults:
        if fault["at"] is None:
            match = next((t for t in taken
                          if t[:2] == (fault["rank"], fault["kind"]) and t[2] >= fault["requested"] - 1), None)
            if match is not None:
                taken.remove(match)
                fault["at"] = match[2]


def _spread(values: list) -> Optional[dict]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def summarize(baseline: list, chaos: list, faults: list) -> dict:
    """Per fault: detection, recovery, the requests it cut (those not served that finished after it
    and before the next fault); per kind: their spreads and sums; overall: served against the
    baseline, tokens against the baseline's."""
    for k, fault in enumerate(faults):
        at = fault["at"] if fault["at"] is not None else fault["requested"]
        fault["detected_s"] = None if fault["down"] is None else fault["down"] - at
        fault["back_s"] = None if fault["up"] is None else fault["up"] - at
        until = faults[k + 1]["requested"] if k + 1 < len(faults) else float("inf")
        cut = [r for r in chaos if r["outcome"] != "ok" and fault["requested"] <= r["done"] < until]
        fault.update({o: sum(r["outcome"] == o for r in cut) for o in OUTCOMES[1:]})
    unattributed = [r for r in chaos if r["outcome"] != "ok" and (not faults or r["done"] < faults[0]["requested"])]
    kinds = {}
    for kind in sorted({f["kind"] for f in faults}):
        mine = [f for f in faults if f["kind"] == kind]
        kinds[kind] = {"count": len(mine), "ranks": sorted(f["rank"] for f in mine),
                       "detected_s": _spread([f["detected_s"] for f in mine]),
                       "back_s": _spread([f["back_s"] for f in mine]),
                       "undetected": sum(f["detected_s"] is None for f in mine),
                       **{o: sum(f[o] for f in mine) for o in OUTCOMES[1:]}}
    served = [r for r in chaos if r["outcome"] == "ok"]
    base_ok = {r["i"]: r["tokens"] for r in baseline if r["outcome"] == "ok"}
    compared = [r for r in served if r["i"] in base_ok]
    return {
        "requests": len(chaos),
        "baseline_served": len(base_ok),
        "served": len(served),
        "served_fraction": len(served) / len(base_ok) if base_ok else None,
        "outcomes": {o: sum(r["outcome"] == o for r in chaos) for o in OUTCOMES},
        "baseline_outcomes": {o: sum(r["outcome"] == o for r in baseline) for o in OUTCOMES},
        "tokens_compared": len(compared),
        "tokens_differ": sum(r["tokens"] != base_ok[r["i"]] for r in compared),
        "unattributed_failures": len(unattributed),
        "faults_injected": len(faults),
        "faults_undetected": sum(f["detected_s"] is None for f in faults),
        "faults_not_back": sum(f["back_s"] is None for f in faults),
        "by_kind": kinds,
    }


def resubmitted(url: str) -> Optional[int]:
    """``moe_serve_requests_resubmitted_total`` of the server's ``/metrics`` (None: no answer)."""
    from megatron.inference.metrics import parse_metrics

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            value = parse_metrics(resp.read().decode()).get("moe_serve_requests_resubmitted_total")
    except OSError:
        return None
    return None if value is None else int(value)


def _run(cfg: ChaosConfig, name: str, requests_for, *, with_faults: bool) -> dict:
    fault_dir = os.path.join(cfg.out, f"{name}.faults")
    os.makedirs(fault_dir, exist_ok=True)
    load_before = os.getloadavg()
    server = ServerRun(cfg, name, fault_dir)
    health = HealthLog(server.url)
    health.start()
    faults: list = []
    try:
        requests = requests_for(server.info)
        start = time.time() + 1.0
        results: dict = {}
        load = threading.Thread(target=lambda: results.update(r=_run_load(server.url, requests, cfg.client_timeout,
                                                                            start)), daemon=True)
        load.start()
        if with_faults:
            faults = _inject_faults(cfg, server, health, fault_dir, start + cfg.minutes * 60)
        load.join()
        wall_s = time.time() - start
        resent = resubmitted(server.url)
    finally:
        try:
            health.stop()
        finally:
            code = server.stop()
    _fault_times(read(server.log), faults)
    return {"requests": results["r"], "faults": faults, "wall_s": wall_s, "exit_code": code, "resubmitted": resent,
            "load_average": {"before": load_before, "after": os.getloadavg()}, "info": server.info}


def serving_chaos(cfg: ChaosConfig) -> int:
    """The run ``cfg`` describes (module docstring); 0 when it passed."""
    from megatron.components.loading import find_checkpoint, load_tokenizer

    os.makedirs(cfg.out, exist_ok=True)
    ckpt, manifest = find_checkpoint(cfg.load)
    tokenizer = load_tokenizer(manifest, ckpt)

    def requests_for(info):
        return build_requests(cfg, tokenizer.tokenize, min(info["context_length"], info["max_request_tokens"]))

    baseline_path = os.path.join(cfg.out, "baseline.json")
    if cfg.skip_baseline and os.path.isfile(baseline_path):
        with open(baseline_path) as f:
            baseline = json.load(f)
    else:
        print(f"serving-chaos: fault-free run, {cfg.minutes:g} min at {cfg.rate:g} requests/s", flush=True)
        baseline = _run(cfg, "baseline", requests_for, with_faults=False)
        write_json(baseline_path, baseline, indent=None)
    print(f"serving-chaos: chaos run, {cfg.faults} faults of {', '.join(cfg.kinds)}", flush=True)
    chaos = _run(cfg, "chaos", requests_for, with_faults=True)
    summary = summarize(baseline["requests"], chaos["requests"], chaos["faults"])
    summary["resubmitted"] = chaos["resubmitted"]
    result = {
        "schema": "serving_chaos/1",
        "command": " ".join(["python -m tools.faults"] + sys.argv[1:]),
        "config": dataclasses.asdict(cfg),
        "server": {k: chaos["info"].get(k) for k in ("port", "world_size", "expert_model_parallel_size",
                                                      "context_length", "max_restarts")},
        "machine": {"cpus": os.cpu_count(), "nice": os.nice(0)},
        "baseline": {k: baseline[k] for k in ("wall_s", "exit_code", "load_average")},
        "chaos": {k: chaos[k] for k in ("wall_s", "exit_code", "load_average")},
        "summary": summary,
        "faults": chaos["faults"],
        "requests": [{k: r[k] for k in ("i", "stream", "outcome", "status", "message")}
                     | {"sent": round(r["sent"] - chaos["requests"][0]["sent"], 3),
                        "done": round(r["done"] - r["sent"], 3)} for r in chaos["requests"]],
    }
    write_json(os.path.join(cfg.out, "serving_chaos.json"), result)
    _print(summary, chaos["faults"])
    ok = (summary["faults_injected"] and not summary["faults_undetected"] and not summary["faults_not_back"]
          and not summary["outcomes"]["hang"] and not summary["outcomes"]["broken"] and not summary["tokens_differ"]
          and not summary["unattributed_failures"])
    return 0 if ok else 1


def _print(summary: dict, faults: list) -> None:
    def cell(spread):
        return "-" if spread is None else f"{spread['median']:.1f} [{spread['min']:.1f}, {spread['max']:.1f}]"

    print(f"\n{'#':>3} {'fault':<9} {'rank':>4} {'detected s':>10} {'back s':>8} {'errors':>6} {'hangs':>5} "
          f"{'broken':>6}")
    for f in faults:
        det = "-" if f["detected_s"] is None else f"{f['detected_s']:.1f}"
        back = "-" if f["back_s"] is None else f"{f['back_s']:.1f}"
        print(f"{f['n']:>3} {f['kind']:<9} {f['rank']:>4} {det:>10} {back:>8} {f['error']:>6} {f['hang']:>5} "
              f"{f['broken']:>6}")
    print(f"\n{'fault':<9} {'count':>5} {'detected s':>18} {'back s':>18} {'errors':>6} {'hangs':>5} {'broken':>6}")
    for kind, k in summary["by_kind"].items():
        print(f"{kind:<9} {k['count']:>5} {cell(k['detected_s']):>18} {cell(k['back_s']):>18} {k['error']:>6} "
              f"{k['hang']:>5} {k['broken']:>6}")
    print(f"\nserved {summary['served']}/{summary['requests']} requests ({summary['served_fraction']:.3f} of the "
          f"fault-free run's {summary['baseline_served']}); hangs {summary['outcomes']['hang']}, broken "
          f"{summary['outcomes']['broken']}; tokens differ in {summary['tokens_differ']} of "
          f"{summary['tokens_compared']} served requests; faults undetected {summary['faults_undetected']}, "
          f"not back {summary['faults_not_back']}; resubmitted after a restart {summary.get('resubmitted')}")
