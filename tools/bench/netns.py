"""A shaped network between R ranks on one machine: namespaces, veth pairs, a bridge, ``tc``.

Topology (``R`` = number of ranks, 2..4)::

    netns <prefix>-<pid>-<seq>-r0   veth0 10.213.0.1/24 --+
    netns <prefix>-<pid>-<seq>-r1   veth0 10.213.0.2/24 --+-- p0..p{R-1} -- br0   (netns ...-br)
    ...

Every rank lives in its own network namespace with one veth end (``veth0``); the other end
(``p<i>``) is a port of a bridge that lives in a *dedicated* namespace, not the root one. Nothing
is created in the root namespace, so the host's interfaces, routes and firewall are untouched,
the benchmark cannot reach (or be reached from) any outside network, and deleting the R+1
namespaces removes every veth, the bridge and every qdisc with them. The subnet can therefore be
the same in every run: concurrent runs are separate L2 islands.

Shaping models a full-duplex NIC of ``gbit`` per rank behind a non-blocking switch: a rate
limiter on the rank's egress (``veth0``, its transmit side) and one on the bridge port's egress
(``p<i>``, its receive side). ``tbf`` (default) and ``htb`` both hold TCP goodput at about 95% of
the set rate (the rest is TCP/IP header bytes, which the qdisc counts), run to run within a few
percent; measurements in docs/design/measuring-communication.md. One-way latency (``latency_ms``) needs
the ``netem`` qdisc, attached under the rate limiter on the rank's egress only, so rank-to-rank
one-way delay is ``latency_ms`` (RTT twice that). Kernels built without ``sch_netem`` (like the
one this was developed on) reject a non-zero latency with an error naming the flag instead of
silently ignoring it.

:class:`ShapedNetwork` is a context manager that always tears everything down: on normal exit,
on exceptions, on Ctrl-C (``KeyboardInterrupt``) and on SIGTERM (turned into ``SystemExit`` while
the network exists). Teardown kills any process still inside the namespaces, deletes them and
checks that none is left. A run killed with SIGKILL leaves namespaces behind;
:func:`cleanup_stale` removes those whose owning PID is gone (the CLI calls it on start).
:class:`LoopbackNetwork` is the unshaped fallback (``--no-netns``, non-root, no ``ip``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Iterator, Optional, Sequence

from megatron.common.cli import UserError
from megatron.common.process import pid_alive

__all__ = [
    "PREFIX",
    "MAX_RANKS",
    "Shaper",
    "LinkSpec",
    "RankEndpoint",
    "ShapedNetwork",
    "LoopbackNetwork",
    "netns_available",
    "netem_available",
    "open_network",
    "cleanup_stale",
    "list_project_namespaces",
    "terminate_on_signals",
    "Terminated",
]

log = logging.getLogger(__name__)

PREFIX = "moecomm-bench"
MAX_RANKS = 4
SUBNET = "10.213.0"  # /24; rank i is .{i+1}
RANK_IFNAME = "veth0"
BRIDGE = "br0"
_CMD_TIMEOUT_S = 20.0
# TCP settings inside every rank namespace (the host's are untouched). Without this, every
# all-to-all that follows a compute phase longer than the retransmission timeout restarts from
# slow start, which would tie communication time to compute time.
RANK_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
_NAME_RE = re.compile(r"^(?P<prefix>.+)-(?P<pid>\d+)-(?P<seq>\d+)-(?P<role>br|r\d+|probe)$")
_seq = itertools.count()
_seq_lock = threading.Lock()


class Shaper(str, enum.Enum):
    """Rate limiter qdisc: ``tbf`` (token bucket, default) or ``htb`` (one class, rate = ceil)."""

    tbf = "tbf"
    htb = "htb"


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """Per-rank link: ``gbit`` Gbit/s each direction, ``latency_ms`` one-way rank-to-rank delay."""

    gbit: float = 1.0
    latency_ms: float = 0.0
    shaper: Shaper = Shaper.tbf

    def __post_init__(self):
        if not (self.gbit > 0):
            raise UserError(f"--link-gbit must be > 0, got {self.gbit}")
        if self.gbit > 100:
            raise UserError(f"--link-gbit {self.gbit} is above what a veth can carry here (max 100)")
        if self.latency_ms < 0:
            raise UserError(f"--link-latency-ms must be >= 0, got {self.latency_ms}")
        object.__setattr__(self, "shaper", Shaper(self.shaper))

    @property
    def bits_per_s(self) -> int:
        return int(round(self.gbit * 1e9))

    def as_dict(self) -> dict:
        return {"gbit": self.gbit, "latency_ms": self.latency_ms, "shaper": self.shaper.value}


@dataclasses.dataclass(frozen=True)
class RankEndpoint:
    """Where rank ``rank`` runs: its namespace (None on loopback), address and gloo interface."""

    rank: int
    netns: Optional[str]
    addr: str
    ifname: str

    def command_prefix(self) -> list[str]:
        """argv prefix that runs a command inside this rank's namespace (empty on loopback)."""
        return [] if self.netns is None else ["ip", "netns", "exec", self.netns]


# ----------------------------------------------------------------------------------- commands


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_project_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of existing network namespaces created by this harness (any run)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-") and _NAME_RE.match(n)]


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs inside ``name`` (ours by construction), then delete it."""
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)
    proc = _run(["ip", "netns", "del", name], check=False)
    if proc.returncode != 0 and name in _run(["ip", "netns", "list"], check=False).stdout.split():
        raise RuntimeError(f"could not delete network namespace {name}: {proc.stderr.strip()}")


def cleanup_stale(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Delete this harness's namespaces left by runs that no longer exist; return their names.

    A namespace is stale when the PID in its name is not a live process. ``include_live`` also
    deletes those of live processes (only for a user who knows no other benchmark is running).
    """
    removed = []
    for name in list_project_namespaces(prefix):
        pid = int(_NAME_RE.match(name).group("pid"))
        if include_live or not pid_alive(pid):
            try:
                _delete_namespace(name)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                log.warning("could not remove stale namespace %s: %s", name, e)
                continue
            removed.append(name)
    if removed:
        log.warning("removed %d stale benchmark namespace(s): %s", len(removed), ", ".join(removed))
    return removed


def netns_available() -> tuple[bool, str]:
    """(True, "") when this process can create namespaces, veths and a bridge; else (False, why)."""
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    name = _unique_name(PREFIX, "probe")
    try:
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        _run(["ip", "-n", name, "link", "add", BRIDGE, "type", "bridge"])
        _run(["tc", "-n", name, "qdisc", "add", "dev", "pa", "root", "tbf",
              "rate", "1gbit", "burst", "64kb", "limit", "1mb"])  # fmt: skip
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"namespace setup refused: {e}"
    finally:
        with contextlib.suppress(Exception):
            _delete_namespace(name)
    return True, ""


def netem_available() -> bool:
    """Whether the kernel has the ``netem`` qdisc (needed for a non-zero link latency)."""
    if os.geteuid() != 0 or shutil.which("tc") is None:
        return False
    name = _unique_name(PREFIX, "probe")
    try:
        _run(["ip", "netns", "add", name])
        return _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                    check=False).returncode == 0  # fmt: skip
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return False
    finally:
        with contextlib.suppress(Exception):
            _delete_namespace(name)


def _unique_name(prefix: str, role: str, seq: Optional[int] = None) -> str:
    if seq is None:
        with _seq_lock:
            seq = next(_seq)
    return f"{prefix}-{os.getpid()}-{seq}-{role}"


# ------------------------------------------------------------------------------------ signals


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM/SIGHUP while :func:`terminate_on_signals` is active."""


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into ``SystemExit`` (and keep SIGINT as ``KeyboardInterrupt``) so
    ``finally``/``__exit__`` blocks run; restores the previous handlers. No-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    if signal.getsignal(signal.SIGINT) in (signal.SIG_DFL, None):
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP while tearing down, so a second Ctrl-C cannot cut cleanup short."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ----------------------------------------------------------------------------------- networks


def _tc_commands(link: LinkSpec, delay: bool) -> list[list[str]]:
    """``tc`` subcommands (after ``tc -n NS``; ``DEV`` stands for the device) shaping one egress.

    Rate limiter as root qdisc ``1:``: ``tbf`` with burst >= 64 KiB + one frame, so a full GSO
    super-packet (64 KiB on veth) passes without being re-segmented (and about 1 ms of traffic at
    higher rates), or ``htb`` with one class at rate = ceil. Queue limit: 64 ms of traffic
    (4-64 MiB), so TCP is held back by socket backpressure instead of drops; a 512 KiB queue
    dropped hundreds of packets per 4-rank all-to-all burst for no throughput gain (measured,
    see docs/design/measuring-communication.md). ``delay``: a netem child adds the one-way latency.
    """
    bps = link.bits_per_s
    burst = max(64 * 1024 + 1514, bps // 8 // 1000)
    limit = min(max(4 << 20, bps // 8 * 64 // 1000), 64 << 20)
    netem = ["netem", "delay", f"{link.latency_ms}ms", "limit", "100000"]
    add_delay = delay and link.latency_ms > 0
    if link.shaper is Shaper.tbf:
        cmds = [["qdisc", "add", "dev", "DEV", "root", "handle", "1:", "tbf", "rate", f"{bps}bit",
                 "burst", str(burst), "limit", str(limit)]]  # fmt: skip
        if add_delay:
            cmds.append(["qdisc", "add", "dev", "DEV", "parent", "1:1", "handle", "10:", *netem])
        return cmds
    leaf = netem if add_delay else ["bfifo", "limit", str(limit)]
    return [
        ["qdisc", "add", "dev", "DEV", "root", "handle", "1:", "htb", "default", "1"],
        ["class", "add", "dev", "DEV", "parent", "1:", "classid", "1:1", "htb", "rate", f"{bps}bit",
         "ceil", f"{bps}bit", "burst", str(burst), "cburst", str(burst)],  # fmt: skip
        ["qdisc", "add", "dev", "DEV", "parent", "1:1", "handle", "10:", *leaf],
    ]


class ShapedNetwork:
    """R ranks in their own namespaces behind a shaped bridge (see the module docstring).

    Use as ``with ShapedNetwork(2, LinkSpec(1.0)) as net: ...``; ``net.endpoints[r]`` says where
    rank ``r`` runs; ``net.set_link(LinkSpec(...))`` reshapes in place (the bisection uses it).
    """

    shaped = True

    def __init__(self, num_ranks: int, link: LinkSpec, prefix: str = PREFIX):
        if not 1 <= num_ranks <= MAX_RANKS:
            raise UserError(f"--ranks must be between 1 and {MAX_RANKS}, got {num_ranks}")
        if link.latency_ms > 0 and not netem_available():
            raise UserError(
                f"--link-latency-ms {link.latency_ms}: this kernel has no netem qdisc "
                "(CONFIG_NET_SCH_NETEM), so only 0 is supported here"
            )
        self.num_ranks = num_ranks
        self.link = link
        with _seq_lock:
            seq = next(_seq)
        self.bridge_ns = _unique_name(prefix, "br", seq)
        self.rank_ns = [_unique_name(prefix, f"r{i}", seq) for i in range(num_ranks)]
        self.endpoints = [
            RankEndpoint(i, ns, f"{SUBNET}.{i + 1}", RANK_IFNAME) for i, ns in enumerate(self.rank_ns)
        ]
        self._created: list[str] = []
        self._signal_ctx = None

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_ns, *self.rank_ns]

    # -- lifecycle
    def __enter__(self) -> "ShapedNetwork":
        self._signal_ctx = terminate_on_signals()
        self._signal_ctx.__enter__()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        self._created.append(name)  # before creation: a half-made namespace is still removed
        _run(["ip", "netns", "add", name])

    def _setup(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0",
              "forward_delay", "0"])  # fmt: skip
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for ep in self.endpoints:
            ns = ep.netns
            self._add_ns(ns)
            port = f"p{ep.rank}"
            # Both ends are born inside their namespaces: no name ever appears in the root one.
            _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", RANK_IFNAME,
                  "netns", ns])  # fmt: skip
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ep.addr}/24", "dev", RANK_IFNAME])
            _run(["ip", "-n", ns, "link", "set", RANK_IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        for ns in self.rank_ns:
            for key, value in RANK_SYSCTLS.items():
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])
        self._shape(self.link, replace=False)
        self._wait_links_up()

    def _wait_links_up(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = [
                _run(["ip", "-n", ep.netns, "-o", "link", "show", RANK_IFNAME]).stdout
                for ep in self.endpoints
            ]
            if all("state UP" in s or "LOWER_UP" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth links did not come up: {states}")
            time.sleep(0.05)

    def _tc_devices(self) -> list[tuple[str, str, bool]]:
        """(namespace, device, carries the delay) for every shaped egress."""
        out = []
        for ep in self.endpoints:
            out.append((ep.netns, RANK_IFNAME, True))  # rank transmit
            out.append((self.bridge_ns, f"p{ep.rank}", False))  # rank receive
        return out

    def _shape(self, link: LinkSpec, replace: bool) -> None:
        for ns, dev, delay in self._tc_devices():
            if replace:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            for cmd in _tc_commands(link, delay):
                _run(["tc", "-n", ns, *[dev if a == "DEV" else a for a in cmd]])

    def set_link(self, link: LinkSpec) -> None:
        """Reshape every link to ``link`` (namespaces and connections stay)."""
        if link.latency_ms > 0 and not netem_available():
            raise UserError(f"--link-latency-ms {link.latency_ms}: this kernel has no netem qdisc")
        self._shape(link, replace=True)
        self.link = link

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` per shaped device, for the run record and for tests."""
        return {
            f"{ns}:{dev}": _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.strip()
            for ns, dev, _ in self._tc_devices()
        }

    def close(self) -> None:
        """Remove everything this network created (idempotent); raise if something stays."""
        with _signals_blocked():
            errors = []
            for name in reversed(self._created):
                try:
                    _delete_namespace(name)
                except Exception as e:  # keep going: remove as much as possible
                    errors.append(str(e))
            self._created = []
            if self._signal_ctx is not None:
                ctx, self._signal_ctx = self._signal_ctx, None
                ctx.__exit__(None, None, None)
            left = [n for n in self.namespaces if n in list_project_namespaces(PREFIX)]
            if left or errors:
                raise RuntimeError(f"benchmark network teardown left {left}: {'; '.join(errors)}")

    def describe(self) -> dict:
        return {
            "mode": "netns",
            "shaped": True,
            "ranks": self.num_ranks,
            "link": self.link.as_dict(),
            "topology": "one namespace per rank, veth to a bridge in its own namespace; "
            "rate limit on both directions of every rank link, delay on rank egress",
            "namespaces": self.namespaces,
        }


class LoopbackNetwork:
    """All ranks on 127.0.0.1 (``lo``), unshaped: the fallback when namespaces are unavailable."""

    shaped = False

    def __init__(self, num_ranks: int, reason: str = "--no-netns"):
        if not 1 <= num_ranks <= MAX_RANKS:
            raise UserError(f"--ranks must be between 1 and {MAX_RANKS}, got {num_ranks}")
        self.num_ranks = num_ranks
        self.reason = reason
        self.link = None
        self.endpoints = [RankEndpoint(i, None, "127.0.0.1", "lo") for i in range(num_ranks)]

    def __enter__(self) -> "LoopbackNetwork":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None

    def set_link(self, link: LinkSpec) -> None:
        raise UserError("the link cannot be shaped on loopback (needs network namespaces)")

    def describe(self) -> dict:
        return {"mode": "loopback", "shaped": False, "ranks": self.num_ranks, "link": None,
                "reason": self.reason}  # fmt: skip


def open_network(num_ranks: int, link: LinkSpec, use_netns: bool = True):
    """A :class:`ShapedNetwork` if possible, else a :class:`LoopbackNetwork` with a warning."""
    if not use_netns:
        reason = "--no-netns given"
    else:
        ok, reason = netns_available()
        if ok:
            return ShapedNetwork(num_ranks, link)
    log.warning(
        "WARNING: running over loopback, the link is NOT shaped (%s); communication times "
        "reflect memory copies, not a network",
        reason,
    )
    return LoopbackNetwork(num_ranks, reason)
