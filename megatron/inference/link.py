"""The link between the HTTP front end and rank 0 of the engine when they are two processes.

``python -m megatron.inference.serve --nproc-per-node N`` runs the front end in its own process
(``megatron.inference.launcher``) and the engine's ranks under torchrun, its child. The front end
listens on a Unix socket in a private directory (``multiprocessing.connection``: every connection
proves it holds the authentication key, which only the front end's children inherit, before a
message is read); its address and key reach the ranks in ``$MOE_SERVE_FRONTEND`` and
``$MOE_SERVE_FRONTEND_KEY``. Rank 0 connects once it has built its engine, after every restart
too. Over several machines (``--nnodes``) the front end listens on TCP instead, reached at node
0's rendezvous address, and only node 0's ranks are its children: the other nodes' ranks have an empty
``$MOE_SERVE_FRONTEND``, and rank 0, wherever the rendezvous put it, takes the address and key
from node 0's ranks (``frontend_link``). The messages are typed and versioned
(``megatron.inference.link_messages``):

engine (rank 0) -> front end
    ``Hello`` first (pid, machine, ``protocol.Limits``, what the ready file holds): the engine
    serves; the front end answers ``Welcome``, or ``Refused`` with why (a rank 0 of another link
    version: ``EngineLink.hello`` raises ``FrontendUnreachable`` naming it, a one-line error);
    ``Assigned``, ``Publish``: what the in-process ``Frontend`` is told by the loop;
    ``Beat``: the loop heartbeat's ``Pulse``, from a thread, every ``beat_interval(stall_timeout)``
    seconds, and at once when the loop first runs (``/health`` reads it as it reads a local
    heartbeat: it turns 200 with that first beat);
    ``Drain``: a rank was asked to stop (SIGTERM): stop accepting, finish what is in flight;
    ``Dead``: the engine failed or its watchdog fired; rank 0 exits next.
front end -> engine
    ``Commands`` (new requests, cancellations, stop), as the loop takes them.

The front end (``EngineBridge``) declares the engine lost when rank 0 closes the link (it exited:
at once), sends ``Dead`` or what is no link message of this version, or sends nothing for
``--stall-timeout`` seconds (stopped, or stuck in native code holding the GIL: its beat thread
cannot run). It reads rank 0's messages in whatever
pieces arrive (``FrameReader``), never blocking past a deadline: a rank 0 stopped between a
message's header and its body (``Connection.send`` writes them apart above 16 KiB) is silent like
any other. ``/health`` then says ``lost`` and why. While torchrun has a restart left (at most
``--max-restarts`` engines lost so far; a restart spent on ranks that never said hello shows only
when torchrun exits, and the launcher then fails what is held), the front end holds every request
that has sent its client nothing yet, and new ones, and sends them to the restarted engine
(``Frontend.engine_lost``, ``admission``); a streamed request already answering gets its error
event. Without a restart left every in-flight request gets a 503 and new ones a 503 with
``Retry-After``. A silent rank 0 is SIGKILLed (a stopped process ignores the SIGTERM torchrun
would send, and its peers wait for it in a collective), so that torchrun's ``--max-restarts``
starts the ranks again at once (``give_up`` does the same for another stopped rank, which
``launcher`` finds while the loop stalls). The restarted rank 0 connects to the same socket and the
same front end serves again on the same port. Rank 0 (``EngineLink``) sees the front end close the
link (it declared rank 0 lost, or it died) at its next loop iteration and fails as an engine failure
(exit 1).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import select
import signal
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from typing import Callable, Optional

from megatron.common.process import machine_id, same_machine
from megatron.common.watchdog import Pulse
from megatron.inference import link_messages as messages
from megatron.inference.frontend import Commands

__all__ = ["ENV_ADDRESS", "ENV_AUTHKEY", "FrontendGone", "FrontendUnreachable", "EngineLink", "EngineBridge",
           "FrameReader", "RemoteHeartbeat", "beat_interval", "frontend_link"]

ENV_ADDRESS = "MOE_SERVE_FRONTEND"  # the front end's Unix socket or HOST:PORT; empty on its other nodes
ENV_AUTHKEY = "MOE_SERVE_FRONTEND_KEY"  # its authentication key, hex
FIRST_BEAT_POLL_S = 0.01  # how often rank 0 looks whether its loop has started, to beat at once


def hang_up(conn) -> None:
    """Close ``conn`` so that the peer sees the end at once, also while a thread of this process
    blocks in a ``recv`` on it (a plain close would leave the socket open until that returns)."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass
    conn.close()


def frontend_link() -> Optional[tuple]:
    """``(address, key hex)`` of the front end process this engine serves through, or None (no
    front end process: rank 0 serves HTTP itself). Collective over the world: a rank of the front
    end's node contributes its environment's pair, every other rank None, so that a rank 0 on
    another node gets the pair too."""
    import torch.distributed as dist

    from megatron.common import collectives

    address = os.environ.get(ENV_ADDRESS)
    mine = (address, os.environ[ENV_AUTHKEY]) if address else None
    pairs = collectives.all_gather_object([None] * dist.get_world_size(), mine)
    return next((pair for pair in pairs if pair is not None), None)


def _dial_address(address: str) -> tuple:
    """``multiprocessing.connection``'s address and family for ``$MOE_SERVE_FRONTEND``: a Unix
    socket's path, or HOST:PORT."""
    if "/" in address:
        return address, "AF_UNIX"
    host, _, port = address.rpartition(":")
    return (host, int(port)), "AF_INET"


def beat_interval(stall_timeout_s: float) -> float:
    """Seconds between rank 0's beats: several per ``--stall-timeout``, at most 0.5 s."""
    return min(0.5, stall_timeout_s / 5)


class FrameReader:
    """The messages ``Connection.send`` writes to ``conn``, read with a deadline: its framing (a
    4-byte big-endian length, or -1 and an 8-byte length, then the pickled body) is taken from
    whatever bytes have arrived, so a sender that stops in the middle of a message holds no reader.
    (``Connection.recv`` reads a header and then blocks until its whole body is there.)"""

    NOTHING = object()  # no complete message within the deadline

    def __init__(self, conn):
        self.conn = conn
        self._buf = bytearray()

    @property
    def partial(self) -> bool:
        """Whether part of a message has arrived and not the rest."""
        return bool(self._buf)

    def recv(self, timeout_s: float):
        """The next message, or ``NOTHING`` when none completed within ``timeout_s``; ``EOFError``
        once the peer closed the connection."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._take()
            if message is not self.NOTHING:
                return message
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.conn.fileno()], [], [], left)[0]:
                return self.NOTHING
            chunk = os.read(self.conn.fileno(), 1 << 20)
            if not chunk:
                raise EOFError("the connection was closed")
            self._buf += chunk

    def _take(self):
        buf = self._buf
        if len(buf) < 4:
            return self.NOTHING
        size, start = struct.unpack("!i", buf[:4])[0], 4
        if size == -1:
            if len(buf) < 12:
                return self.NOTHING
            size, start = struct.unpack("!Q", buf[4:12])[0], 12
        if len(buf) < start + size:
            return self.NOTHING
        body = bytes(buf[start:start + size])
        del buf[:start + size]
        return pickle.loads(body)


class FrontendGone(ConnectionError):
    """The front end closed the link (it declared this engine lost, or it exited)."""


class FrontendUnreachable(ConnectionError):
    """Rank 0 cannot reach the front end named by ``$MOE_SERVE_FRONTEND``, or the front end refused
    it (a one-line error)."""


class EngineLink:
    """Rank 0's side of the link: what ``serve_loop`` and ``serve`` call on an in-process
    ``Frontend`` (``take_commands``, ``assigned``, ``publish``, ``request_stop``, ``mark_dead``),
    over the socket; a thread beats the loop's heartbeat and one receives the commands."""

    def __init__(self, conn, heartbeat, beat_interval_s: float):
        self._conn = conn
        self._heartbeat = heartbeat
        self._send_lock = threading.Lock()
        self._inbox: "queue.Queue" = queue.Queue()
        self._closed = threading.Event()
        self.stop_requested = threading.Event()
        threading.Thread(target=self._receive, name="frontend-link-receive", daemon=True).start()
        threading.Thread(target=self._beat, args=(beat_interval_s,), name="frontend-link-beat", daemon=True).start()

    @classmethod
    def connect(cls, address: str, authkey: bytes, heartbeat, beat_interval_s: float,
                timeout_s: float = 30.0) -> "EngineLink":
        """Connect and authenticate within ``timeout_s`` (a front end that accepts nothing must
        not hold rank 0 before its watchdog runs); ``FrontendUnreachable`` naming the address
        otherwise."""
        dialed: dict = {}

        def dial():
            try:
                where, family = _dial_address(address)
                dialed["conn"] = Client(where, family=family, authkey=authkey)
            except (OSError, EOFError, AuthenticationError, ValueError) as err:
                dialed["error"] = err

        thread = threading.Thread(target=dial, name="frontend-link-connect", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if "conn" in dialed:
            return cls(dialed["conn"], heartbeat, beat_interval_s)
        err = dialed.get("error")
        why = (f"the front end did not answer within {timeout_s:g} s" if err is None else
               f"the front end refused ${ENV_AUTHKEY}" if isinstance(err, AuthenticationError) else
               f"no front end listens there ({getattr(err, 'strerror', None) or err})")
        raise FrontendUnreachable(f"${ENV_ADDRESS} {address}: {why}")

    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(messages.encode(message))

    def _receive(self) -> None:
        """The front end's messages into the inbox; then None once it closed the link, or the
        ``LinkMismatch`` that ended it."""
        while True:
            try:
                self._inbox.put(messages.decode(self._conn.recv(), "the front end"))
            except (EOFError, OSError, messages.LinkMismatch) as err:
                self._closed.set()
                self._inbox.put(err if isinstance(err, messages.LinkMismatch) else None)
                return

    def _beat(self, interval_s: float) -> None:
        """A beat every ``interval_s``; until the loop has run, its state is looked at every
        ``FIRST_BEAT_POLL_S`` so that the first beat of a running loop goes out at once."""
        started, last = False, time.monotonic()
        while not self._closed.wait(interval_s if started else min(interval_s, FIRST_BEAT_POLL_S)):
            pulse = self._heartbeat.pulse()
            if not (started or pulse.started) and time.monotonic() - last < interval_s:
                continue
            started, last = pulse.started, time.monotonic()
            try:
                self._send(messages.Beat(pulse))
            except OSError:
                return

    def hello(self, limits, info: dict, timeout_s: float = 30.0) -> None:
        """Say that the engine serves, and wait up to ``timeout_s`` for the front end to take it;
        ``FrontendUnreachable`` (one line) when it refuses, speaks another link version or does not
        answer."""
        self._send(messages.Hello(os.getpid(), machine_id(), limits, info))
        try:
            answer = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            answer = f"the front end did not answer rank 0's hello within {timeout_s:g} s"
        if isinstance(answer, messages.Welcome):
            return
        if isinstance(answer, messages.Refused):
            answer = f"the front end refused this rank 0: {answer.reason}"
        elif answer is None:
            answer = "the front end closed the link before it answered rank 0's hello"
        elif not isinstance(answer, (str, messages.LinkMismatch)):
            answer = f"the front end answered rank 0's hello with {answer.kind!r}"
        raise FrontendUnreachable(str(answer))

    def take_commands(self, wait_s: float) -> Commands:
        """Everything the front end sent since the last call (blocks up to ``wait_s`` for the
        first); ``FrontendGone`` once it closed the link."""
        cmds = Commands()
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
            while True:
                if item is None:
                    raise FrontendGone("the front end closed the link to rank 0 (it declared the engine lost, "
                                       "or it exited)")
                if not isinstance(item, messages.Commands):
                    raise item if isinstance(item, messages.LinkMismatch) else messages.LinkMismatch(
                        f"the front end sent {item.kind!r} while rank 0 serves")
                cmds.submits += item.submits
                cmds.cancels += item.cancels
                cmds.stop = cmds.stop or item.stop
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return cmds

    def assigned(self, placed: dict) -> None:
        if placed:
            self._send(messages.Assigned(placed))

    def publish(self, updates: list, stats: list) -> None:
        self._send(messages.Publish(updates, stats))

    def request_stop(self) -> None:
        """The ranks were asked to stop: the front end drains and then sends ``stop``."""
        if not self.stop_requested.is_set():
            self.stop_requested.set()
            self._send(messages.Drain())

    def mark_dead(self, reason: str) -> None:
        """The engine failed: the front end answers every in-flight request with a 503."""
        try:
            self._send(messages.Dead(reason))
        except OSError:
            pass

    def wait_answered(self, timeout: float) -> None:
        """Nothing to wait for: the front end, which outlives this process, answers its clients."""

    def join(self, timeout: float) -> None:
        self._closed.set()
        hang_up(self._conn)


class RemoteHeartbeat:
    """The engine loop's heartbeat as rank 0 last reported it: ``pulse()`` as ``Heartbeat.pulse``,
    its age grown by the time since the report; no pulse (starting) before the first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: Optional[tuple] = None  # (Pulse, when it arrived)

    def update(self, pulse: Pulse) -> None:
        """A beat's ``Pulse``."""
        self._last = (pulse, self._clock())

    def reset(self) -> None:
        self._last = None

    def pulse(self) -> Pulse:
        last = self._last
        if last is None:
            return Pulse(None, 0.0, 0, started=False)
        pulse, at = last
        age = None if pulse.age_s is None else pulse.age_s + max(self._clock() - at, 0.0)
        return dataclasses.replace(pulse, age_s=age)


class EngineBridge:
    """The front end's side of the link (module docstring). ``start`` accepts rank 0's
    connections from then on (one at a time: a new one replaces a lost one); ``wait_engine``
    blocks until the first engine said hello; ``serve(frontend)`` then forwards the frontend's
    commands and hands it what rank 0 sends. ``max_restarts``: torchrun's ``--max-restarts``
    (while fewer engines were lost, a lost one will restart)."""

    def __init__(self, listener, *, stall_timeout_s: float, max_restarts: int = 0,
                 log: Callable[[str], None] = print):
        self.listener = listener
        self.stall_timeout_s = stall_timeout_s
        self.max_restarts = max_restarts
        self.losses = 0  # engines lost so far
        self.log = log
        self.heartbeat = RemoteHeartbeat()
        self.frontend = None
        self.engines = 0  # engines that said hello so far
        self.engine_stopped = False  # the engine closed the link after being told to stop (a clean stop)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn = None  # the engine serving now
        self._hello: Optional[messages.Hello] = None  # its hello
        self._reader: Optional[FrameReader] = None  # its messages
        self._connected = threading.Condition(self._lock)
        self._closing = False

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def hello(self) -> Optional[messages.Hello]:
        return self._hello

    def start(self) -> "EngineBridge":
        threading.Thread(target=self._accept, name="engine-bridge-accept", daemon=True).start()
        return self

    def wait_engine(self, timeout_s: float) -> bool:
        """Whether an engine is connected, waiting up to ``timeout_s`` for one."""
        with self._lock:
            return self._connected.wait_for(lambda: self._conn is not None, timeout_s)

    def serve(self, frontend) -> None:
        """Serve ``frontend`` from now on (once, after the first hello)."""
        with self._lock:
            self.frontend = frontend
            conn, reader = self._conn, self._reader
        if conn is not None:
            self._start_receiving(conn, reader)
        threading.Thread(target=self._forward, name="engine-bridge-send", daemon=True).start()

    def close(self) -> None:
        self._closing = True
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            hang_up(conn)
        self.listener.close()

    # --- threads -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):  # closed, or a connection without the key
                if self._closing:
                    return
                continue
            reader = FrameReader(conn)
            try:
                hello = reader.recv(60)
                if hello is FrameReader.NOTHING:
                    raise EOFError("no hello")
                hello = messages.decode(hello, "rank 0")
                if not isinstance(hello, messages.Hello):
                    raise messages.LinkMismatch(f"rank 0 sent {hello.kind!r} before its hello")
                conn.send(messages.encode(messages.Welcome()))
            except messages.LinkMismatch as err:
                self.log(f"frontend: refused a connection: {err}")
                try:
                    conn.send(messages.encode(messages.Refused(str(err))))
                except OSError:
                    pass
                conn.close()
                continue
            except (EOFError, OSError, pickle.UnpicklingError):
                conn.close()
                continue
            with self._lock:
                old, self._conn, self._hello = self._conn, conn, hello
                self._reader = reader
                self.engines += 1
                frontend = self.frontend
                self._connected.notify_all()
            if old is not None:
                hang_up(old)
            self.heartbeat.reset()
            self.log(f"frontend: engine {self.engines} connected (rank 0 pid {hello.pid})")
            if frontend is not None:
                frontend.engine_up(hello.limits)
                self._start_receiving(conn, reader)

    def _start_receiving(self, conn, reader: FrameReader) -> None:
        threading.Thread(target=self._receive, args=(conn, reader), name="engine-bridge-receive",
                         daemon=True).start()

    def _receive(self, conn, reader: FrameReader) -> None:
        """Rank 0's messages to the frontend until the link closes or falls silent (no complete
        message for ``--stall-timeout``, also when one stopped half sent)."""
        frontend = self.frontend
        pid = self._hello.pid
        last = time.monotonic()
        poll_s = min(0.1, self.stall_timeout_s / 10)
        while self._conn is conn:
            try:
                message = reader.recv(poll_s)
                if message is FrameReader.NOTHING:
                    silent = time.monotonic() - last
                    if silent > self.stall_timeout_s:
                        half = "; a message stopped half sent" if reader.partial else ""
                        self._lose(conn, f"rank 0 of the engine (pid {pid}) sent nothing for {silent:.1f} s "
                                         f"(--stall-timeout {self.stall_timeout_s:g}{half}): it is stopped, or stuck "
                                         f"holding the GIL", kill=[pid])
                    continue
                message = messages.decode(message, "rank 0")
            except (EOFError, OSError, pickle.UnpicklingError):
                self._lose(conn, "rank 0 of the engine closed the link: it exited")
                return
            except messages.LinkMismatch as err:
                self._lose(conn, str(err))
                return
            last = time.monotonic()
            if isinstance(message, messages.Publish):
                frontend.publish(message.updates, message.stats)
            elif isinstance(message, messages.Assigned):
                frontend.assigned(message.placed)
            elif isinstance(message, messages.Beat):
                self.heartbeat.update(message.pulse)
            elif isinstance(message, messages.Drain):
                self.log("frontend: the engine was asked to stop: draining")
                frontend.request_stop()
            elif isinstance(message, messages.Dead):
                self._lose(conn, message.reason)
            else:
                self._lose(conn, f"rank 0 sent {message.kind!r} while it serves")
                return

    def give_up(self, reason: str, kill: list) -> None:
        """Declare the engine serving now lost (``reason``) and SIGKILL the processes ``kill`` (its
        stopped ranks: ``launcher`` finds them while the engine stalls)."""
        self._lose(self._conn, reason, kill=kill)

    def _lose(self, conn, reason: str, *, kill: list = ()) -> None:
        """The engine on ``conn`` is gone: hold what is in flight and new requests until an engine
        connects again when it will restart, fail them otherwise; SIGKILL the pids ``kill`` (a
        silent rank 0, stopped ranks) if they are on this machine."""
        with self._lock:
            if conn is None or self._conn is not conn:
                return
            self._conn = None
            machine = self._hello.machine
        hang_up(conn)
        self.heartbeat.reset()
        frontend = self.frontend
        if frontend.stop_requested.is_set() and not frontend.in_flight:
            self.engine_stopped = True
            self.log("frontend: the engine stopped")
            return
        while True:  # what was queued for the lost engine: its requests are held or failed below
            try:
                frontend.commands.get_nowait()
            except queue.Empty:
                break
        self.losses += 1
        restart = self.losses <= self.max_restarts and not frontend.stop_requested.is_set()  # draining: no
        frontend.engine_lost(reason, will_restart=restart)
        killed = []
        for pid in kill if same_machine(machine) else ():
            try:
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(str(pid))
            except OSError:
                pass
        note = f"; SIGKILLed pid {', '.join(killed)} so that torchrun restarts the engine" if killed else ""
        then = ("waiting for it to come back, holding the requests that have not started answering" if restart else
                "stopping: failing the requests in flight" if frontend.stop_requested.is_set() else
                f"--max-restarts {self.max_restarts} spent: failing the requests in flight")
        self.log(f"frontend: engine lost: {reason}{note}; {then}")

    def _forward(self) -> None:
        """The frontend's commands to the engine serving now (nothing while none is)."""
        frontend = self.frontend
        stopped = None  # the connection told to stop
        while not self._closing:
            cmds = frontend.take_commands(0.05)
            conn = self._conn
            if conn is None or not (cmds.submits or cmds.cancels or (cmds.stop and stopped is not conn)):
                continue
            try:
                with self._send_lock:
                    conn.send(messages.encode(messages.Commands(cmds.submits, cmds.cancels, cmds.stop)))
            except OSError:
                self._lose(conn, "rank 0 of the engine closed the link: it exited")
                continue
            if cmds.stop:
                stopped = conn
