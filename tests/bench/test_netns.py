"""Network namespaces: setup, shaping and guaranteed teardown (root only; skipped otherwise).

Everything the harness creates lives inside its own namespaces, so "nothing left behind" is
checked as: none of the run's namespaces exist afterwards, and the root namespace's interfaces
and qdiscs are exactly what they were before.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tools.bench import netns
from tools import repo_root
from tools.bench.launcher import launch
from tools.bench.schema import RankResult, WorkerSpec

ok, why = netns.netns_available() if os.geteuid() == 0 else (False, "not root")
# network namespaces: slow, and only as root with iproute2
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")]


def _root_state():
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
    return names, sorted(qdiscs.splitlines())


def _ours(pid=None):
    pid = os.getpid() if pid is None else pid
    return [n for n in netns.list_project_namespaces() if n.startswith(f"{netns.PREFIX}-{pid}-")]


def test_setup_shapes_every_link_and_teardown_removes_everything():
    before = _root_state()
    with netns.ShapedNetwork(3, netns.LinkSpec(0.5)) as net:
        assert sorted(_ours()) == sorted(net.namespaces) and len(net.namespaces) == 4
        qd = net.qdiscs()
        assert len(qd) == 6  # rank egress + bridge-port egress for each of 3 ranks
        assert all("tbf" in q and "500Mbit" in q for q in qd.values()), qd
        addrs = subprocess.run(net.endpoints[2].command_prefix() + ["ip", "-o", "-4", "addr", "show", "veth0"],
                               capture_output=True, text=True).stdout  # fmt: skip
        assert "10.213.0.3/24" in addrs
        net.set_link(netns.LinkSpec(2.0, shaper="htb"))
        assert all("htb" in q for q in net.qdiscs().values())
        assert _root_state() == before  # nothing was created in the root namespace
    assert _ours() == []
    assert _root_state() == before


def test_exception_mid_run_still_cleans_up():
    before = _root_state()
    with pytest.raises(RuntimeError, match="boom"):
        with netns.ShapedNetwork(2, netns.LinkSpec(1.0)):
            assert len(_ours()) == 3
            raise RuntimeError("boom")
    assert _ours() == []
    assert _root_state() == before


def test_nonzero_latency_needs_netem():
    if netns.netem_available():
        pytest.skip("this kernel has netem; the refusal path does not apply")
    with pytest.raises(ValueError, match="--link-latency-ms"):
        netns.ShapedNetwork(2, netns.LinkSpec(1.0, latency_ms=1.0))
    assert _ours() == []


_HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from tools.bench import netns
    with netns.ShapedNetwork(2, netns.LinkSpec(1.0)) as net:
        print("ready", flush=True)
        time.sleep(120)
    """
)


def _interactive_signals():
    """Child set-up: SIGINT as in a terminal. A shell started without job control (CI in the
    background) makes its children ignore SIGINT, and the benchmark rightly keeps an inherited
    SIG_IGN, so without this the Ctrl-C cases would wait forever there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_run_cleans_up(sig):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=repo_root())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_interactive_signals)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        assert len(_ours(proc.pid)) == 3
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert _ours(proc.pid) == []


def test_cleanup_stale_removes_only_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}-{dead.pid}-0-r0"
    live = f"{netns.PREFIX}-{os.getpid()}-999-r0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        removed = netns.cleanup_stale()
        assert stale in removed and live not in removed
        assert stale not in netns.list_project_namespaces()
        assert live in netns.list_project_namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_synthetic_worker_across_namespaces(tmp_path):
    """Two ranks in two namespaces complete a step over gloo through the bridge."""
    spec = WorkerSpec("synthetic", str(tmp_path / "out"), warmup=0, steps=1,
                      options={"tokens": 8, "hidden": 8, "ffn": 8, "topk": 1, "layers": 1})  # fmt: skip
    with netns.ShapedNetwork(2, netns.LinkSpec(1.0)) as net:
        raw = launch(net, "tools.bench.synthetic_worker", spec, str(tmp_path), timeout_s=100)
    for d in raw:
        r = RankResult.from_dict(d)
        r.validate(1)
        assert r.a2a_bytes_dispatch == [4 * 8 * 4]  # 4 of 8 rows go to the other rank, 8 fp32 each
    assert _ours() == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_cli_signal_mid_run_stops_workers_and_removes_namespaces(sig, code):
    """Ctrl-C / SIGTERM while the workers run: the CLI kills them and removes its namespaces."""
    script = os.path.join(repo_root(), "scripts", "bench_ep.py")
    proc = subprocess.Popen(
        [sys.executable, script, "--variants", "synthetic", "--warmup", "0", "--steps", "100000",
         "--synthetic-tokens", "8", "--synthetic-hidden", "8", "--synthetic-ffn", "8", "--timeout-s", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interactive_signals,
    )  # fmt: skip
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not workers:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers never started"
            ranks = sorted(n for n in _ours(proc.pid) if not n.endswith("-br"))
            pids = [subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
                    for n in ranks]  # fmt: skip
            if len(ranks) == 2 and all(pids):
                workers = [int(p) for group in pids for p in group]
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "namespaces removed" in err
    assert _ours(proc.pid) == []
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
