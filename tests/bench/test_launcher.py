"""The launcher: per-rank environment, result collection, timeout and failure handling.

No timing is asserted beyond the launcher's own wall-clock bound (timeout plus its kill grace).
"""

import os
import time

import pytest

from tools.bench.launcher import LaunchError, LaunchTimeout, launch
from tools.bench.netns import LoopbackNetwork
from tools.bench.schema import WorkerSpec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # starts processes
def test_timeout_kills_a_hung_worker_and_its_children(tmp_path):
    spec = WorkerSpec("hang", str(tmp_path / "out"))
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match="timed out after 3s"):
        launch(LoopbackNetwork(2), "tests.bench.hang_worker", spec, str(tmp_path), timeout_s=3)
    assert time.monotonic() - t0 < 3 + 10  # timeout + SIGTERM/SIGKILL grace
    for rank in range(2):
        pid_file = tmp_path / f"hang{rank}.pid"
        assert pid_file.exists(), "the hung worker never started"
        worker, grandchild = (int(x) for x in pid_file.read_text().split())
        assert not _alive(worker)
        assert not _alive(grandchild)  # same process group: killed with the worker


@pytest.mark.slow  # starts processes
def test_failing_rank_surfaces_its_stderr_and_stops_the_others(tmp_path):
    spec = WorkerSpec("fail", str(tmp_path / "out"))
    with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] failed") as info:
        launch(LoopbackNetwork(2), "tests.bench.fail_worker", spec, str(tmp_path), timeout_s=60)
    assert "simulated failure on rank 1" in str(info.value)
    assert not isinstance(info.value, LaunchTimeout)


def test_refuses_to_overwrite_results(tmp_path):
    spec = WorkerSpec("x", str(tmp_path / "out"))
    os.makedirs(spec.output_dir)
    open(spec.result_path(0), "w").close()
    with pytest.raises(LaunchError, match="already exists"):
        launch(LoopbackNetwork(2), "tests.bench.hang_worker", spec, str(tmp_path), timeout_s=5)


def test_open_network_falls_back_to_loopback_with_a_warning(monkeypatch, caplog):
    from tools.bench import netns

    monkeypatch.setattr(netns, "netns_available", lambda: (False, "not root (simulated)"))
    with caplog.at_level("WARNING"):
        net = netns.open_network(2, netns.LinkSpec(1.0), use_netns=True)
    assert isinstance(net, netns.LoopbackNetwork) and not net.shaped
    assert "NOT shaped" in caplog.text and "not root (simulated)" in caplog.text
    assert net.describe()["reason"] == "not root (simulated)"
    with pytest.raises(ValueError, match="loopback"):
        net.set_link(netns.LinkSpec(2.0))


def test_start_ranks_runs_a_subset_and_reports_a_signalled_rank(tmp_path):
    """``start_ranks`` (the serving benchmark's server and load client): one process per chosen
    endpoint, its own log name; ``signal`` reaches the whole process group; a rank that died of it
    fails ``check`` with its log."""
    import signal

    from tools.bench.launcher import start_ranks

    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    net = LoopbackNetwork(2)
    with start_ranks(net, ["-m", "tests.bench.hang_worker", str(spec)], str(tmp_path), endpoints=net.endpoints[1:],
                     log_prefix="client") as procs:
        pid_file = tmp_path / "hang1.pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.ranks == [1] and procs.running() and os.path.basename(procs.logs[0]) == "client1.log"
        assert not (tmp_path / "hang0.pid").exists()
        procs.check()  # running is not a failure
        procs.signal(signal.SIGTERM)
        while procs.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] failed"):
            procs.check()
    worker, grandchild = (int(x) for x in pid_file.read_text().split())
    while (_alive(worker) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the signal reached both; they may take a moment to exit on a loaded machine
    assert not _alive(worker) and not _alive(grandchild)


def test_free_port_is_outside_the_kernels_ephemeral_range_and_bindable():
    """A port from bind(0) is one the kernel hands to any other process's bind(0) or outgoing
    connection too (a busy machine took one between free_port and the server's bind: EADDRINUSE);
    below the ephemeral range only a process naming it can."""
    import socket

    from tools.bench.launcher import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
