"""Pretraining over several nodes, each node a torchrun agent of ``scripts/launch_multinode.sh``: here two
agents on one machine (``--nnodes 2``, c10d rendezvous on 127.0.0.1), one rank each, EP = 2 spanning
them; under Slurm, ``scripts/slurm_pretrain.sbatch`` submitted to a private two-node Slurm on this
machine.

The runs have ``run_a``'s flags (``conftest.RUN_A_ARGS``: 6 steps, EP = 2, checkpoints at 3 and 6) and
are compared with that one-node run. Tolerance: exact (``==`` on the logged losses and gradient
norms). The world is the same (2 ranks, global ranks 0 and 1 whichever agent holds them; the ranks
are interchangeable, their data shard follows the global rank) and gloo runs the same collectives
between the same ranks, so every reduction adds the same numbers in the same order; the agents only
change how the processes were started and met.
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import kill_agent, read_jsonl, run_agents, start_agent
from tests.training.conftest import MODULE, RUN_A_ARGS

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps(save) -> dict:
    """The last record of each step in ``save/metrics.jsonl`` (a restarted job logs its steps again)."""
    return {r["step"]: r for r in read_jsonl(save / "metrics.jsonl") if "event" not in r}


def _assert_run_a_losses(save, run_a, steps):
    one_node = _steps(run_a[1])
    got = _steps(save)
    for step in steps:
        assert got[step]["lm_loss"] == one_node[step]["lm_loss"], step
        assert got[step]["grad_norm"] == one_node[step]["grad_norm"], step


def _log(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def test_two_agents_give_the_one_node_losses(run_a, tmp_path):
    """Two agents (``--nnodes 2``, one rank each) train ``run_a``'s 6 steps with its losses and
    gradient norms, and write the same checkpoints."""
    save = tmp_path / "ckpt"
    args = RUN_A_ARGS + ["--save", save, "--data-cache-path", run_a[0] / "cache"]
    codes = run_agents(tmp_path, MODULE, args)
    assert codes == [0, 0], "\n".join(_log(tmp_path / f"agent{i}.log")[-3000:] for i in range(2))
    _assert_run_a_losses(save, run_a, range(1, 7))
    assert {"iter_0000003", "iter_0000006"} <= set(os.listdir(save))
    # rank 0, on whichever agent it is, wrote the closing line
    logs = [_log(tmp_path / f"agent{i}.log") for i in range(2)]
    assert sum("pretrain_gpt: finished at iteration 6" in log for log in logs) == 1


def _stopped_agent(agents, timeout: float = 180.0):
    """The agent with a stopped (SIGSTOP) process below it, once there is one."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for agent in agents:
            if agent.poll() is not None:
                raise AssertionError(f"agent {agent.pid} exited with {agent.returncode} before the fault")
            for child in psutil.Process(agent.pid).children(recursive=True):
                try:
                    if child.status() == psutil.STATUS_STOPPED:
                        return agent
                except psutil.NoSuchProcess:
                    continue
        time.sleep(0.2)
    raise AssertionError("no rank stopped")


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def test_a_lost_agent_is_replaced_and_the_job_resumes_from_its_last_checkpoint(run_a, tmp_path):
    """Two agents with ``MAX_RESTARTS=1`` and ``--load`` = ``--save``; the first hosts the rendezvous
    (started first: it holds MASTER_PORT, as the node at MASTER_ADDR does on a cluster). The second
    agent's rank stops itself after step 4 (``tools.faults``: the checkpoint of step 3 is on disk,
    step 4's is not due) and that agent is killed with it (SIGKILL to the agent and its rank: a lost
    node). The surviving agent's rank fails on the lost peer and the agent restarts it; a replacement
    agent (what a cluster's scheduler starts for the lost node) joins the rendezvous, and the job
    resumes from iteration 3: steps 4-6 have ``run_a``'s losses exactly (module docstring), nothing
    saved was lost, and the job ends at 6 with both agents' exit 0."""
    from tools.bench.launcher import free_port
    from tools.faults.inject import ENV, request

    save, faults = tmp_path / "ckpt", tmp_path / "faults"
    faults.mkdir()
    for rank in (0, 1):  # only the second agent's ranks read the requests: its rank takes its own
        request(str(faults), rank, "stop", at=4)
    args = ["pretrain_gpt", *RUN_A_ARGS, "--save", save, "--load", save, "--data-cache-path", run_a[0] / "cache"]
    port = free_port()

    def agent(name, env=None):
        return start_agent(tmp_path / f"{name}.log", "tools.faults.rank", args, port=port, max_restarts=1, env=env)

    agents = {"host": agent("host")}
    try:
        _wait_listening(port)
        agents["lost"] = agent("lost", {ENV: str(faults)})
        assert _stopped_agent(list(agents.values())) is agents["lost"]
        kill_agent(agents["lost"])
        agents["replacement"] = agent("replacement")
        for name in ("host", "replacement"):
            assert agents[name].wait(timeout=240) == 0, _log(tmp_path / f"{name}.log")[-3000:]
    finally:
        for a in agents.values():
            kill_agent(a)
    logs = _log(tmp_path / "host.log") + _log(tmp_path / "replacement.log")
    assert "starting at iteration 3" in logs, logs[-3000:]  # the restarted job loaded iter_0000003
    checkpoints = [r["step"] for r in read_jsonl(save / "metrics.jsonl") if r.get("event") == "checkpoint"]
    assert checkpoints == [3, 6]
    steps = [r["step"] for r in read_jsonl(save / "metrics.jsonl") if "event" not in r]
    assert steps[-3:] == [4, 5, 6] and steps.count(4) == 2, steps  # step 4 ran before the loss and again
    _assert_run_a_losses(save, run_a, (4, 5, 6))


# --- Slurm ------------------------------------------------------------------------------------------

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def _slurm_conf(root, ports) -> str:
    """A private Slurm of two nodes (n0, n1) on this machine: no authentication (auth/none), its
    state, spool, logs and pid files under ``root``."""
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=moe-test", "SlurmctldHost=localhost", f"SlurmctldPort={ports[0]}", "SlurmUser=root",
        "SlurmdUser=root", "AuthType=auth/none", "CredType=cred/none", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid", f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "ReturnToService=2",
        f"NodeName=n0 NodeHostname={os.uname().nodename} NodeAddr=127.0.0.1 Port={ports[1]} CPUs=2 State=UNKNOWN",
        f"NodeName=n1 NodeHostname={os.uname().nodename} NodeAddr=127.0.0.1 Port={ports[2]} CPUs=2 State=UNKNOWN",
        "PartitionName=local Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP", ""]))
    return str(conf)


@pytest.fixture
def local_slurm(tmp_path):
    """``SLURM_CONF`` of a private two-node Slurm (``_slurm_conf``) whose daemons run for the test."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("a private Slurm's slurmd runs as root")
    from tools.bench.launcher import free_port

    root = tmp_path / "slurm"
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True)
    conf = _slurm_conf(root, [free_port() for _ in range(3)])
    env = dict(os.environ, SLURM_CONF=conf)
    daemons = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for cmd in (["slurmctld", "-D", "-i", "-f", conf], ["slurmd", "-D", "-f", conf, "-N", "n0"],
                           ["slurmd", "-D", "-f", conf, "-N", "n1"])]
    try:
        deadline = time.monotonic() + 60
        while True:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True).stdout
            if states.split() == ["idle", "idle"]:
                break
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(_log(p)[-1500:] for p in sorted(root.glob("*.log")))
                raise AssertionError(f"the private Slurm did not come up (sinfo: {states!r}):\n{logs}")
            time.sleep(0.5)
        yield conf
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


def _job_end(job: str, env, timeout: float = 300) -> dict:
    """The state and exit code of Slurm job ``job`` once it has ended (``scontrol`` every 0.5 s:
    ``sbatch --wait`` polls at growing intervals, up to seconds after the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return {"JobState": fields["JobState"], "ExitCode": fields.get("ExitCode")}
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"Slurm job {job} still running after {timeout:g} s")


def test_slurm_example_trains_on_two_nodes(run_a, tmp_path, local_slurm):
    """``sbatch scripts/slurm_pretrain.sbatch`` (two nodes, one task each: ``srun`` starts
    ``scripts/launch_multinode.sh`` on each) with ``run_a``'s flags: the job ends with exit 0 and
    ``run_a``'s losses. The submission overrides what this CPU machine lacks and the names it cannot
    resolve: no GPUs (``--gpus-per-node=0``, one rank per node), one CPU per task, the rendezvous at
    127.0.0.1 (the nodes' names are not host names here)."""
    from tools.bench.launcher import free_port

    save = tmp_path / "ckpt"
    exports = {"GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "PYTHON": sys.executable, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out",
           "--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in exports.items()]),
           "scripts/slurm_pretrain.sbatch", *map(str, RUN_A_ARGS),
           "--save", str(save), "--data-cache-path", str(run_a[0] / "cache")]
    env = dict(os.environ, SLURM_CONF=local_slurm)
    submitted = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    state = _job_end(submitted.stdout.strip().split(";")[0], env)
    output = _log(next(tmp_path.glob("slurm-*.out")))
    assert state == {"JobState": "COMPLETED", "ExitCode": "0:0"}, f"{state}\n{output[-3000:]}"
    assert "pretrain_gpt: finished at iteration 6" in output
    _assert_run_a_losses(save, run_a, range(1, 7))
