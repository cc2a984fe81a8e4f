"""The front end and rank 0 as two ends of a Unix socket (``megatron.inference.link``), in one
process: the real ``Frontend`` on 127.0.0.1 behind the real ``EngineBridge`` (a ``Listener`` in a
private directory, ``--stall-timeout`` 0.5 s), and on the engine's side the real ``EngineLink``
driven by a scripted loop thread (take the commands, tick the heartbeat, answer each request with
"ok"), or a bare authenticated connection that says hello and then nothing, as a stopped rank 0
does. No model, no torch.distributed.

- A connection without the key is refused (and the front end still accepts rank 0); requests
  travel over the link (tokens, the ``x-dp-rank`` assignment); ``/health`` follows rank 0's beats.
- A rank 0 that falls silent is declared lost after the stall timeout: the request in flight gets
  a 503 naming it, ``/health`` 503 ``lost`` with the reason, a new request a 503 with
  ``Retry-After``, the silent process is SIGKILLed; an engine that connects again serves;
  ``/metrics`` counts the lost request and the restart.
- A closed link (rank 0 exited) fails what is in flight at once; a ``Dead`` message fails it with
  the engine's reason, and a message that is no link message of this version with one line naming it.
- A rank 0 of other code (another link version, untyped tuples) is refused in one line, and a
  rank 0 answered by a front end of other code stops with one line.
- Rank 0 drains on its signal through the front end, which then tells it to stop; rank 0 sees a
  front end that closed the link as ``FrontendGone``.
- Over TCP (several nodes) the link works the same; ``frontend_link`` hands node 0's address and key
  to a rank 0 on another node.
- ``--nproc-per-node``, ``--max-restarts`` and ``--nnodes`` misused are refused in one line, and so is
  a ``$MOE_SERVE_FRONTEND`` no front end listens on.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from multiprocessing.connection import Client, Listener

import pytest

from megatron.common.process import machine_id
from megatron.common.watchdog import Heartbeat, Pulse
from megatron.inference import protocol as P
from megatron.inference.engine import TokenUpdate
from megatron.inference.frontend import Frontend, FrontendConfig
from megatron.inference.link import EngineBridge, EngineLink, FrontendGone
from megatron.inference import link_messages as M
from megatron.inference.link_messages import Beat, Hello, Publish, encode
from tests.serving.test_frontend import CharTokenizer, _request

STALL_S = 0.5
LIMITS = P.Limits(context=64, vocab_size=300, max_request_tokens=48)


def _ok(submit):
    return [TokenUpdate(submit.request_id, [ord("o"), ord("k")], finished=True)]


class ScriptedRank0:
    """Rank 0 behind an ``EngineLink``: a loop thread that answers every request with "ok" (or
    nothing, ``answer=False``; or ``script(submit) -> [TokenUpdate]``) and records the commands and
    the submits it got."""

    def __init__(self, address: str, authkey: bytes, *, answer: bool = True, script=None):
        self.heartbeat = Heartbeat()
        self.link = EngineLink.connect(address, authkey, self.heartbeat, beat_interval_s=0.05, timeout_s=10)
        self.link.hello(LIMITS, {"model": "m"})
        self.script = script or (_ok if answer else (lambda submit: []))
        self.commands = []
        self.submits = []
        self.error = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                cmds = self.link.take_commands(0.01)
            except FrontendGone as err:
                self.error = err
                return
            self.heartbeat.tick()
            if cmds.submits or cmds.cancels or cmds.stop:
                self.commands.append(cmds)
            self.submits += cmds.submits
            for submit in cmds.submits:
                updates = self.script(submit)
                if updates:
                    self.link.assigned({submit.request_id: 1})
                    self.link.publish(updates, [])

    def close(self):
        self._stop.set()
        self.thread.join(5)
        self.link.join(1)


class Setup:
    def __init__(self, tcp: bool = False, max_restarts: int = 0):
        self.dir = tempfile.mkdtemp(prefix="link-", dir="/tmp")  # a Unix socket path has at most 107 bytes
        self.authkey = os.urandom(32)
        if tcp:  # as over several nodes: HOST:PORT
            listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=self.authkey)
            self.address = f"127.0.0.1:{listener.address[1]}"
        else:
            self.address = os.path.join(self.dir, "engine.sock")
            listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self.logs = []
        self.bridge = EngineBridge(listener, stall_timeout_s=STALL_S, max_restarts=max_restarts,
                                   log=self.logs.append).start()
        self.engines = []
        self.frontend = None

    def engine(self, **kw) -> ScriptedRank0:
        self.engines.append(ScriptedRank0(self.address, self.authkey, **kw))
        assert self.bridge.wait_engine(10)
        return self.engines[-1]

    def serve(self, **config) -> Frontend:
        self.frontend = Frontend(tokenizer=CharTokenizer(), chat_render=P.simple_chat_prompt,
                                 heartbeat=self.bridge.heartbeat,
                                 config=FrontendConfig(served_model="m", limits=self.bridge.hello.limits, port=0,
                                                       stall_timeout=STALL_S, **config))
        self.frontend.start()
        self.frontend.url = f"http://127.0.0.1:{self.frontend.port}"
        self.bridge.serve(self.frontend)
        return self.frontend

    def close(self):
        for engine in self.engines:
            engine.close()
        self.bridge.close()
        if self.frontend is not None:
            self.frontend.request_stop()
            self.frontend.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def linked():
    setup = Setup()
    yield setup
    setup.close()


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _health(url):
    return _request(url, "/health")[:2]


def test_requests_travel_over_the_link_and_health_follows_the_beats(linked):
    from multiprocessing import AuthenticationError

    with pytest.raises(AuthenticationError):  # without the key nothing is read
        Client(linked.address, family="AF_UNIX", authkey=b"not the key")
    linked.engine()
    f = linked.serve()
    _until(lambda: _health(f.url)[0] == 200)
    status, body, headers = _request(f.url, "/v1/completions", {"prompt": "ab", "max_tokens": 4})
    assert status == 200 and body["choices"][0]["text"] == "ok" and headers["x-dp-rank"] == "1"
    assert [c.submits[0].prompt for c in linked.engines[0].commands] == [[ord("a"), ord("b")]]


def test_a_silent_rank0_is_lost_killed_and_a_new_engine_serves(linked):
    sleeper = subprocess.Popen(["sleep", "600"])  # plays the stopped rank 0's process
    try:
        conn = Client(linked.address, family="AF_UNIX", authkey=linked.authkey)
        conn.send(encode(Hello(sleeper.pid, machine_id(), LIMITS, {"model": "m"})))
        conn.send(encode(Beat(Pulse(0.0, 0.0, 1))))
        assert linked.bridge.wait_engine(10)
        f = linked.serve()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
            status, body, _ = in_flight.result(timeout=30)
        message = body["error"]["message"]
        assert status == 503 and f"rank 0 of the engine (pid {sleeper.pid}) sent nothing for" in message
        assert sleeper.wait(10) == -9  # SIGKILLed: torchrun restarts the ranks at once
        status, health = _health(f.url)
        assert status == 503 and health["status"] == "lost" and "--stall-timeout 0.5" in health["reason"]
        status, body, headers = _request(f.url, "/v1/completions", {"prompt": "a"})
        assert status == 503 and headers["retry-after"] == "1" and "sent nothing" in body["error"]["message"]
        conn.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    linked.engine()  # the restarted rank 0
    _until(lambda: _health(f.url)[0] == 200)
    status, body, _ = _request(f.url, "/v1/completions", {"prompt": "a"})
    assert status == 200 and body["choices"][0]["text"] == "ok"
    assert any(f"SIGKILLed pid {sleeper.pid}" in line for line in linked.logs)
    # /metrics: the request in flight was lost, the 503 while lost was rejected, the engine restarted once
    from megatron.inference.metrics import parse_metrics

    with urllib.request.urlopen(f.url + "/metrics", timeout=10) as resp:
        metrics = parse_metrics(resp.read().decode())
    assert metrics['moe_serve_requests_total{status="lost"}'] == 1
    assert metrics['moe_serve_requests_total{status="rejected"}'] == 1
    assert metrics['moe_serve_requests_total{status="completed"}'] == 1
    assert metrics["moe_serve_engine_restarts_total"] == 1


def test_a_rank0_stopped_in_the_middle_of_a_message_is_lost_like_a_silent_one(linked):
    """Rank 0 stopped between a large message's header and the rest of its body (over 16 KiB,
    ``Connection.send`` writes them apart): the front end must not block reading that message; its
    stall check runs, and the request in flight gets a 503 after the stall timeout."""
    sleeper = subprocess.Popen(["sleep", "600"])  # plays the stopped rank 0's process
    try:
        conn = Client(linked.address, family="AF_UNIX", authkey=linked.authkey)
        conn.send(encode(Hello(sleeper.pid, machine_id(), LIMITS, {"model": "m"})))
        conn.send(encode(Beat(Pulse(0.0, 0.0, 1))))
        assert linked.bridge.wait_engine(10)
        f = linked.serve()
        _until(lambda: _health(f.url)[0] == 200)
        big = pickle.dumps(encode(Publish([], [{"pad": "x" * 100_000}])))
        os.write(conn.fileno(), struct.pack("!i", len(big)) + big[:1000])  # the header and a part
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
            status, body, _ = in_flight.result(timeout=30)
        message = body["error"]["message"]
        assert status == 503 and f"rank 0 of the engine (pid {sleeper.pid}) sent nothing for" in message
        assert "a message stopped half sent" in message
        assert sleeper.wait(10) == -9
        conn.close()
    finally:
        sleeper.kill()
        sleeper.wait()


def _answer(conn, timeout=10):
    assert conn.poll(timeout), "no answer"
    return conn.recv()


@pytest.mark.parametrize("hello,refusal", [
    ((M.VERSION + 1, "hello", pickle.dumps({})), f"rank 0 speaks link version {M.VERSION + 1}, not {M.VERSION}"),
    (("hello", os.getpid(), machine_id(), LIMITS, {"model": "m"}), "rank 0 sent ('hello', "),  # untyped, positional
    (encode(Beat(Pulse(0.0, 0.0, 1))), "rank 0 sent 'beat' before its hello"),
])
def test_a_rank0_of_other_code_is_refused_in_one_line(linked, hello, refusal):
    """A rank 0 whose first message is no hello of this link version: the front end logs one line
    naming what it sent, answers ``Refused`` with it and closes the link; no engine is connected,
    and a rank 0 of this version is still taken afterwards."""
    conn = Client(linked.address, family="AF_UNIX", authkey=linked.authkey)
    conn.send(hello)
    answer = M.decode(_answer(conn), "the front end")
    assert isinstance(answer, M.Refused) and answer.reason.startswith(refusal) and "\n" not in answer.reason
    with pytest.raises(EOFError):
        _answer(conn)
    conn.close()
    assert not linked.bridge.wait_engine(0.2)
    assert [line for line in linked.logs if "refused" in line] == [f"frontend: refused a connection: {answer.reason}"]
    linked.engine()
    assert linked.bridge.engines == 1


def test_an_unknown_message_from_rank0_loses_the_engine_in_one_line(linked):
    """Rank 0 sends a kind the front end does not know: the engine is declared lost at once with
    one line naming it (not read as something else, not left until the stall timeout)."""
    conn = Client(linked.address, family="AF_UNIX", authkey=linked.authkey)
    conn.send(encode(Hello(os.getpid(), machine_id(), LIMITS, {"model": "m"})))
    assert linked.bridge.wait_engine(10)
    assert isinstance(M.decode(_answer(conn), "the front end"), M.Welcome)
    f = linked.serve()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
        command = M.decode(_answer(conn), "the front end")  # the request reached rank 0
        assert isinstance(command, M.Commands) and len(command.submits) == 1
        conn.send((M.VERSION, "frobnicate", pickle.dumps({})))
        status, body, _ = in_flight.result(timeout=30)
    reason = f"rank 0 sent an unknown link message 'frobnicate' (link version {M.VERSION})"
    assert status == 503 and body["error"]["message"] == f"the engine stopped serving: {reason}"
    status, health = _health(f.url)
    assert status == 503 and health["reason"] == reason
    conn.close()


class _OtherFrontEnd:
    """A front end that answers the first message with ``answer`` (an envelope), as one of other
    code would."""

    def __init__(self, address: str, authkey: bytes, answer):
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.thread = threading.Thread(target=self._run, args=(answer,), daemon=True)
        self.thread.start()

    def _run(self, answer):
        conn = self.listener.accept()
        conn.recv()
        conn.send(answer)
        self.conn = conn


@pytest.mark.parametrize("answer,message", [
    ((M.VERSION + 1, "welcome", pickle.dumps({})),
     f"the front end speaks link version {M.VERSION + 1}, not {M.VERSION}: the two run different code"),
    (encode(M.Refused("rank 0 speaks link version 7, not 1: the two run different code")),
     "the front end refused this rank 0: rank 0 speaks link version 7, not 1: the two run different code"),
    (encode(M.Commands([], [], True)), "the front end answered rank 0's hello with 'commands'"),
])
def test_a_front_end_of_other_code_stops_rank0_in_one_line(tmp_path, answer, message):
    """Rank 0's hello answered by anything but ``Welcome`` of its version: ``FrontendUnreachable``
    (``serve``'s one-line error) naming it, before rank 0 serves."""
    from megatron.inference.link import FrontendUnreachable

    address, authkey = str(tmp_path / "engine.sock"), os.urandom(32)
    front_end = _OtherFrontEnd(address, authkey, answer)
    link = EngineLink.connect(address, authkey, Heartbeat(), beat_interval_s=10, timeout_s=10)
    with pytest.raises(FrontendUnreachable) as err:
        link.hello(LIMITS, {"model": "m"}, timeout_s=10)
    assert str(err.value) == message
    link.join(1)
    front_end.thread.join(5)
    front_end.listener.close()


def test_frames_are_read_in_any_pieces():
    """``FrameReader`` reads what ``Connection.send`` wrote, whole or in pieces, small and large
    messages alike; nothing until a message is complete, ``EOFError`` once the sender closed."""
    from multiprocessing import Pipe

    from megatron.inference.link import FrameReader

    receiver, sender = Pipe(duplex=False)
    reader = FrameReader(receiver)
    sender.send(("beat", 1.0))
    sender.send(("publish", "y" * 50_000))
    assert reader.recv(1) == ("beat", 1.0) and reader.recv(1) == ("publish", "y" * 50_000)
    body = pickle.dumps(("assigned", {7: 1}))
    frame = struct.pack("!i", len(body)) + body
    for piece in (frame[:2], frame[2:9], frame[9:]):
        assert reader.recv(0.01) is FrameReader.NOTHING
        os.write(sender.fileno(), piece)
    assert reader.recv(1) == ("assigned", {7: 1}) and not reader.partial
    sender.close()
    with pytest.raises(EOFError):
        reader.recv(1)


def test_a_closed_link_or_a_dead_engine_fails_in_flight_requests_at_once(linked):
    first = linked.engine(answer=False)
    f = linked.serve()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
        _until(lambda: first.commands)
        first.close()  # rank 0 exited: its socket closes
        status, body, _ = in_flight.result(timeout=30)
    assert status == 503 and "closed the link: it exited" in body["error"]["message"]
    assert _health(f.url)[1]["status"] == "lost"

    second = linked.engine(answer=False)
    _until(lambda: _health(f.url)[0] == 200)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_request, f.url, "/v1/completions", {"prompt": "a"})
        _until(lambda: second.commands)
        second.link.mark_dead("the engine loop failed on rank 1 (RuntimeError: boom)")
        status, body, _ = in_flight.result(timeout=30)
    assert status == 503 and body["error"]["message"] == ("the engine stopped serving: the engine loop failed on "
                                                           "rank 1 (RuntimeError: boom)")
    _until(lambda: second.error is not None)  # the front end closed the link: rank 0 fails and exits
    assert "the front end closed the link" in str(second.error)


def test_rank0_drains_through_the_front_end_which_then_stops_it(linked):
    engine = linked.engine()
    f = linked.serve()
    engine.link.request_stop()  # SIGTERM on the ranks
    _until(lambda: f.stop_requested.is_set())
    _until(lambda: any(c.stop for c in engine.commands))
    assert sum(c.stop for c in engine.commands) == 1  # told once


def test_requests_travel_over_a_tcp_link():
    """Over several nodes the link is TCP (``$MOE_SERVE_FRONTEND`` HOST:PORT): the same
    authentication, the same messages."""
    from multiprocessing import AuthenticationError

    setup = Setup(tcp=True)
    try:
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", int(setup.address.rpartition(":")[2])), family="AF_INET", authkey=b"not the key")
        setup.engine()
        f = setup.serve()
        status, body, _ = _request(f.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["choices"][0]["text"] == "ok"
    finally:
        setup.close()


def _links(rank, world, envs):
    from megatron.inference.link import frontend_link

    os.environ.update(envs[rank])
    with_front_end = frontend_link()
    for key in envs[rank]:
        del os.environ[key]
    return with_front_end, frontend_link()


def test_rank0_on_another_node_takes_the_front_ends_link_from_its_node():
    """``frontend_link`` over 2 gloo ranks: the pair of the rank whose node runs the front end
    reaches every rank (rank 0 of a node with an empty ``$MOE_SERVE_FRONTEND`` included); without
    a front end process every rank gets None."""
    from tools.spawn import run_distributed

    node0 = {"MOE_SERVE_FRONTEND": "node0:4711", "MOE_SERVE_FRONTEND_KEY": "ab"}
    other = {"MOE_SERVE_FRONTEND": ""}
    assert run_distributed(_links, 2, [other, node0]) == [(("node0:4711", "ab"), None)] * 2


@pytest.mark.parametrize("argv,env,message", [
    (["--nproc-per-node", "0"], {}, "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "2"], {"RANK": "0"}, "--nproc-per-node starts torchrun itself"),
    (["--max-restarts", "1"], {}, "--max-restarts needs --nproc-per-node"),
    (["--nproc-per-node", "2", "--max-restarts", "-1"], {}, "--max-restarts must be >= 0, got -1"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0:29400"], {}, "--nnodes > 1 needs --nproc-per-node"),
    (["--nproc-per-node", "1", "--nnodes", "2"], {}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29400"], {},
     "0 <= --node-rank < --nnodes"),
])
def test_front_end_flags_are_refused_in_one_line(argv, env, message, serve_ckpts, monkeypatch, capsys):
    from megatron.inference.serve import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["--load", serve_ckpts["standard"], *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron.inference.serve: error: ") and message in err and "\n" not in err


def _serve_rank(rank, world, argv):
    """``serve.main(argv)`` in a forked rank; megatron-core's engine module enables ``faulthandler``
    on import, which needs the real stderr: imported before ``main_in_rank`` captures it."""
    import megatron.core.inference.engines  # noqa: F401

    from tests.training.test_reliability import main_in_rank

    return main_in_rank(rank, world, "megatron.inference.serve", argv)


def test_a_rank0_that_finds_no_front_end_says_so_in_one_line(serve_ckpts, tmp_path, monkeypatch):
    """``$MOE_SERVE_FRONTEND`` naming no listening front end (a stale environment, a front end
    gone): rank 0 builds its engine, fails to connect and exits with one line naming the address,
    not a traceback."""
    from tools.spawn import run_distributed

    address = str(tmp_path / "gone.sock")
    monkeypatch.setenv("MOE_SERVE_FRONTEND", address)  # inherited by the forked rank
    monkeypatch.setenv("MOE_SERVE_FRONTEND_KEY", "00" * 32)
    argv = ["--load", serve_ckpts["standard"], "--port", "0"]
    code, _, err = run_distributed(_serve_rank, 1, argv, timeout_s=240)[0]
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"megatron.inference.serve: error: $MOE_SERVE_FRONTEND {address}: "
                                            "no front end listens there (No such file or directory)"), err


def test_ranks_under_the_front_end_leave_its_port_alone(serve_ckpts, monkeypatch):
    """The front end of ``--nproc-per-node`` holds ``--port`` across restarts: a (re)started rank 0
    under it must not check that it can bind the port (it cannot: the front end holds it), while
    rank 0 serving HTTP itself still refuses a busy port in one line."""
    import socket

    from megatron.common.cli import UserError
    from megatron.inference.link import ENV_ADDRESS
    from megatron.inference.serve import _check_args, build_parser

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = build_parser().parse_args(["--load", serve_ckpts["standard"], "--port", str(port)])
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(UserError, match=f"--port {port}: cannot bind"):
            _check_args(args)
        monkeypatch.setenv(ENV_ADDRESS, "/nonexistent/engine.sock")
        _check_args(args)
