"""The HTTP front end in its own process, the engine's ranks under torchrun as its child.

``python -m megatron.inference.serve --nproc-per-node N [--max-restarts K] --load CKPT ...``:
this process checks the flags and the layout, loads the checkpoint's tokenizer (not the model),
listens on a Unix socket in a private temporary directory (``megatron.inference.link``), and
starts ``torchrun --standalone --nproc-per-node N --max-restarts K -m megatron.inference.serve
<the same arguments>`` with the socket's address and key in the environment. Rank 0 connects
once its engine is built; the front end then binds ``--host``/``--port``, writes
``--ready-file`` and serves. When rank 0 stops answering (stopped, killed, crashed, its engine
failed) the front end answers at once (``link.EngineBridge``), torchrun restarts the ranks, the
new rank 0 reconnects to the same socket and the same port serves again.

While the engine's loop is stalled (``/health`` says ``stalled``: some rank made no progress for
``--stall-timeout``), the front end looks for a stopped rank among torchrun's descendants (state
``T`` in ``/proc``): a SIGSTOPped rank other than rank 0 keeps rank 0 beating while every rank
waits for it in a collective, and it would ignore torchrun's SIGTERM for 30 s. It declares the
engine lost and SIGKILLs that rank, so torchrun restarts the ranks at once.

It ends when torchrun does: after SIGTERM or SIGINT (stop accepting, let what is in flight finish
within ``--shutdown-timeout``, tell the engine to stop) with 0; when torchrun gives up (no restart
left) with its exit code, every request in flight answered 503 first. torchrun dies with this
process (``PR_SET_PDEATHSIG``).

Over several machines (``--nnodes M --rdzv-endpoint HOST:PORT``, the same command on each with its
``--node-rank``), node 0 runs the front end and its torchrun agent joins torchrun's c10d rendezvous
at HOST:PORT instead of ``--standalone``; the front end listens for rank 0 on TCP (every interface,
a free port, the same authentication), reached at HOST (node 0's address as the other nodes reach
it). Every other node's
process becomes its node's torchrun agent (``run_node``). Rank 0 may be on any node: it takes the
link's address and key from node 0's ranks (``link.frontend_link``). A stopped rank is looked for
among node 0's processes only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Listener
from typing import NoReturn, Optional

__all__ = ["run_frontend", "run_node", "torchrun_command", "stopped_below"]


def torchrun_command(nproc: int, max_restarts: int, rank_command, argv, nnodes: int = 1,
                     rdzv_endpoint: Optional[str] = None) -> list:
    rendezvous = (["--standalone"] if nnodes == 1 else
                  [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"])
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", *rank_command, *argv]


def _torchrun_env(args, **extra) -> dict:
    """torchrun's environment. Over several nodes the ranks' store is each rendezvous round's rank
    0's, not the agents' shared one: with that, a restarted or replaced node never gets the
    round's ``MASTER_ADDR`` (pytorch/pytorch#135712)."""
    env = dict(os.environ, **extra)
    if args.nnodes > 1:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def run_node(args, argv: list, rank_command) -> NoReturn:
    """A node other than the front end's (``--node-rank`` > 0): this process becomes the node's
    torchrun agent (``exec``); its ranks have an empty ``$MOE_SERVE_FRONTEND`` (module docstring)."""
    from megatron.inference.link import ENV_ADDRESS

    cmd = torchrun_command(args.nproc_per_node, args.max_restarts, rank_command, argv, args.nnodes,
                           args.rdzv_endpoint)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, _torchrun_env(args, **{ENV_ADDRESS: ""}))


def stopped_below(root_pid: int) -> list:
    """``(pid, RANK)`` of the processes below ``root_pid`` that are stopped (SIGSTOP: state ``T``),
    from ``/proc`` (Linux; none elsewhere). ``RANK`` is None where its environment is unreadable."""
    children, stopped = {}, set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]  # the command name may hold spaces
        children.setdefault(int(ppid), []).append(int(entry))
        if state == "T":
            stopped.add(int(entry))
    below, todo = [], [root_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            below.append(pid)
            todo.append(pid)
    return [(pid, _rank_of(pid)) for pid in below if pid in stopped]


def _rank_of(pid: int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if env.get(b"RANK", b"").isdigit() else None


def _die_with_parent() -> None:
    """In torchrun's process before it runs: SIGTERM when the front end's process ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_frontend(args, argv: list, rank_command) -> int:
    """The front end process of ``serve --nproc-per-node`` (module docstring); its exit code."""
    from megatron.common.files import write_json
    from megatron.inference.frontend import Frontend
    from megatron.inference.link import ENV_ADDRESS, ENV_AUTHKEY, EngineBridge
    from megatron.inference.options import (check_layout, checkpoint_chat, engine_config, frontend_config, http_url,
                                            served_name)
    from megatron.components.loading import load_tokenizer

    engine_config(args)
    # refused here, before any rank starts
    _, manifest, ckpt, _, _ = check_layout(args, args.nproc_per_node * args.nnodes)
    tokenizer = load_tokenizer(manifest, ckpt)
    render, chat_kind = checkpoint_chat(manifest, ckpt)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    workdir = tempfile.mkdtemp(prefix="moe-serve-")  # mode 0700: only this user reaches the socket
    authkey = secrets.token_bytes(32)
    if args.nnodes == 1:
        address = os.path.join(workdir, "engine.sock")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
    else:  # rank 0 may be on another node: TCP, reached at node 0's rendezvous address
        listener = Listener(("", 0), family="AF_INET", authkey=authkey)
        address = f"{args.rdzv_endpoint.rpartition(':')[0]}:{listener.address[1]}"
    bridge = EngineBridge(listener, stall_timeout_s=args.stall_timeout, max_restarts=args.max_restarts,
                          log=lambda line: print(line, flush=True))
    child = subprocess.Popen(torchrun_command(args.nproc_per_node, args.max_restarts, rank_command, argv, args.nnodes,
                                              args.rdzv_endpoint),
                             env=_torchrun_env(args, **{ENV_ADDRESS: address, ENV_AUTHKEY: authkey.hex()}),
                             preexec_fn=_die_with_parent)
    frontend = None
    try:
        bridge.start()
        while not bridge.wait_engine(0.2):
            if child.poll() is not None:
                print(f"the engine exited with status {child.returncode} before it served", file=sys.stderr,
                      flush=True)
                return child.returncode or 1
            if stop["signal"] is not None:
                return 0
        hello = bridge.hello
        frontend = Frontend(tokenizer=tokenizer, chat_render=render, heartbeat=bridge.heartbeat,
                            config=frontend_config(args, hello.limits))
        port = frontend.start()
        bridge.serve(frontend)
        url = http_url(args.host, port)
        if args.ready_file:
            write_json(args.ready_file, {"url": url, "port": port, **hello.info, "frontend_pid": os.getpid(),
                                         "max_restarts": args.max_restarts})
        ranks = (f"{args.nproc_per_node} ranks" if args.nnodes == 1 else
                 f"{args.nproc_per_node} ranks on each of {args.nnodes} nodes")
        print(f"serving {served_name(args)} on {url} (front end pid {os.getpid()}; {ranks} under "
              f"torchrun, --max-restarts {args.max_restarts}; chat: {chat_kind})", flush=True)
        return _supervise(child, frontend, bridge, stop, args.shutdown_timeout)
    finally:
        bridge.close()
        _end(child)
        if frontend is not None:
            frontend.request_stop()
            frontend.join(timeout=args.shutdown_timeout + 10)
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(child, frontend, bridge, stop: dict, shutdown_timeout: float) -> int:
    """Serve until torchrun exits; drain on a signal (module docstring). The exit code."""
    stopping_since = None
    while child.poll() is None:
        _, health = frontend.health()
        if bridge.connected and health.get("status") == "stalled":
            stopped = stopped_below(child.pid)
            if stopped:
                names = ", ".join(f"rank {rank} (pid {pid})" for pid, rank in stopped)
                bridge.give_up(f"{names} of the engine is stopped (SIGSTOP): {health['reason']}",
                               [pid for pid, _ in stopped])
        if stop["signal"] is not None and not frontend.stop_requested.is_set():
            print(f"received signal {stop['signal']}: draining {frontend.in_flight} request(s)", flush=True)
            frontend.request_stop()
        if frontend.stop_requested.is_set():
            stopping_since = stopping_since or time.monotonic()
            # the bridge tells a connected engine to stop once drained, and torchrun then exits on
            # its own (SIGTERMing it meanwhile prints its SignalException traceback); none
            # connected, or one that does not stop: end torchrun
            idle = not bridge.connected and not bridge.engine_stopped
            if idle or time.monotonic() - stopping_since > shutdown_timeout + 30:
                _end(child)
        time.sleep(0.1)
    code = child.returncode
    if frontend.stop_requested.is_set():
        print("server stopped", flush=True)
        return 0
    frontend.mark_dead(f"the engine exited with status {code} (torchrun: no restart left)")
    frontend.wait_answered(2.0)
    print(f"the engine exited with status {code}; no restart left", file=sys.stderr, flush=True)
    return code if code and code > 0 else 1


def _end(child, grace_s: float = 35.0) -> None:
    """SIGTERM torchrun (it stops its ranks: a stopped one only after its own 30 s), SIGKILL it
    after ``grace_s``."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
