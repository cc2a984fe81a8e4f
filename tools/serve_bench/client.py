"""The serving benchmark's load client: ``python -m tools.serve_bench.client SPEC.json``.

The benchmark (``tools.serve_bench.cli``) starts it where rank 0's HTTP server listens: inside
rank 0's network namespace, talking to the server over that namespace's loopback, so HTTP traffic
never crosses the shaped link that carries the ranks' all-to-alls (``--no-netns``: plain
loopback). The spec (:class:`ClientSpec`) lists phases; for each one the client

1. reads ``/metrics`` (the engines' counters: tokens, busy time, all-to-all bytes and seconds),
2. sends every request of the phase at its arrival time (seconds from the phase's start), each on
   its own thread as a streaming ``/v1/completions`` with the prompt as token ids,
   ``temperature`` 0 (greedy), ``ignore_eos`` (exactly ``max_tokens`` tokens) and
   ``return_token_ids`` (so tokens are counted exactly, whatever text they decode to),
3. waits for every response, waits ``settle_s`` for the engines' last stats to reach rank 0, and
   reads ``/metrics`` again.

Per request it records the send time, the time to the first token and to the end of the stream
(``[DONE]``) and the tokens received. Progress (requests sent, done, failed) is written to
``progress_path`` twice a second for the benchmark's progress line; the result to
``result_path``. Standard library only (``http.client``), plus the project's metrics parser.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import sys
import threading
import time
import urllib.parse
from typing import Optional

from megatron.common.files import write_json

__all__ = ["ClientSpec", "stream_completion", "scrape_metrics", "run", "main"]


@dataclasses.dataclass
class ClientSpec:
    """What the client does: ``phases`` = ``[{"name", "requests": [{"at", "prompt", "max_tokens"}]}]``."""

    url: str
    phases: list
    result_path: str
    progress_path: Optional[str] = None
    request_timeout_s: float = 600.0
    settle_s: float = 0.3

    @classmethod
    def read(cls, path: str) -> "ClientSpec":
        with open(path) as f:
            return cls(**json.load(f))

    def write(self, path: str) -> None:
        write_json(path, dataclasses.asdict(self), indent=None)


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def stream_completion(url: str, prompt: list, max_tokens: int, timeout: float) -> dict:
    """One streaming greedy completion; ``{"sent", "ttft_s", "e2e_s", "output_tokens", "ok",
    "finish_reason", "error", "dp_rank"}`` with times in ``perf_counter`` seconds (``sent``) and
    seconds from the send (the others); ``dp_rank``: the data-parallel engine that served it (the
    server's ``x-dp-rank`` header), or None."""
    body = json.dumps({"prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0, "stream": True,
                       "ignore_eos": True, "return_token_ids": True})
    out = {"sent": None, "ttft_s": None, "e2e_s": None, "output_tokens": 0, "ok": False, "finish_reason": None,
           "error": None, "dp_rank": None}
    conn = _connection(url, timeout)
    sent = time.perf_counter()
    out["sent"] = sent
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode("utf-8", "replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            out["error"] = f"HTTP {resp.status}: {text}"[:500]
            return out
        rank = resp.getheader("x-dp-rank")
        if rank is not None and rank.isdigit():
            out["dp_rank"] = int(rank)
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                out["ok"] = out["error"] is None
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                out["error"] = str(chunk["error"].get("message"))[:500]
                continue
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - sent
                out["output_tokens"] += len(ids)
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
        else:
            out["error"] = "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as err:
        out["error"] = f"{type(err).__name__}: {err}"[:500]
    finally:
        out["e2e_s"] = time.perf_counter() - sent
        conn.close()
    return out


def scrape_metrics(url: str, timeout: float = 30.0) -> dict:
    """``/metrics`` as ``{sample: value}``."""
    from megatron.inference.metrics import parse_metrics

    conn = _connection(url, timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            raise RuntimeError(f"GET /metrics answered {resp.status}")
        return parse_metrics(text)
    finally:
        conn.close()


class _Progress:
    def __init__(self, path: Optional[str]):
        self.path = path
        self.lock = threading.Lock()
        self.state = {"phase": None, "total": 0, "sent": 0, "done": 0, "failed": 0, "phase_start": None}
        self.stop = threading.Event()
        self.thread = None
        if path:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.state[key] += n

    def _write(self) -> None:
        with self.lock:
            state = dict(self.state)
        if state["phase_start"] is not None:
            state["elapsed_s"] = time.perf_counter() - state.pop("phase_start")
        else:
            state.pop("phase_start")
        write_json(self.path, state, indent=None)

    def _loop(self) -> None:
        while not self.stop.wait(0.5):
            self._write()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self._write()


def _run_phase(spec: ClientSpec, phase: dict, progress: _Progress) -> dict:
    requests = sorted(phase["requests"], key=lambda r: r["at"])
    with progress.lock:
        progress.state.update(phase=phase["name"], total=len(requests), sent=0, done=0, failed=0, phase_start=None)
    clock_start = time.perf_counter()  # the phase's window on the host clock (the servers' step spans)
    before = scrape_metrics(spec.url)
    results: list = [None] * len(requests)
    threads = []

    def one(i, req):
        res = stream_completion(spec.url, req["prompt"], req["max_tokens"], spec.request_timeout_s)
        res["prompt_tokens"] = len(req["prompt"])
        res["max_tokens"] = int(req["max_tokens"])
        results[i] = res
        progress.add("done")
        if not res["ok"]:
            progress.add("failed")

    start = time.perf_counter()
    with progress.lock:
        progress.state["phase_start"] = start
    for i, req in enumerate(requests):
        delay = start + float(req["at"]) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, req), daemon=True)
        t.start()
        threads.append(t)
        progress.add("sent")
    for t in threads:
        t.join()
    end = max([r["sent"] + r["e2e_s"] for r in results], default=start)
    time.sleep(spec.settle_s)
    after = scrape_metrics(spec.url)
    clock_end = time.perf_counter()
    for r, req in zip(results, requests):
        r["scheduled_s"] = float(req["at"])
        r["sent"] = r["sent"] - start  # seconds from the phase's start
    return {"name": phase["name"], "duration_s": end - start, "requests": results,
            "metrics_before": before, "metrics_after": after, "clock_start": clock_start, "clock_end": clock_end}


def run(spec: ClientSpec) -> dict:
    progress = _Progress(spec.progress_path)
    try:
        phases = [_run_phase(spec, phase, progress) for phase in spec.phases]
    finally:
        progress.close()
    return {"url": spec.url, "phases": phases}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tools.serve_bench.client SPEC.json", file=sys.stderr)
        return 2
    spec = ClientSpec.read(argv[0])
    result = run(spec)
    write_json(spec.result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
