"""``megatron.common.cli``: a ``UserError`` is one ``error:`` line and exit status 2; any other
exception, a ``ValueError`` from deep inside a command included, keeps its traceback (status 1
from the interpreter), by default in ``run_cli`` and ``Subcommands.main`` alike."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron.common.cli import Subcommands, UserError, run_cli, user_input

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _commands() -> Subcommands:
    commands = Subcommands("prog")

    @commands.add("bad", "a user error", lambda p: p.add_argument("--lr", type=float))
    def _bad(args):
        if args.lr < 0:
            raise UserError(f"--lr must be >= 0, got {args.lr:g}")

    @commands.add("bug", "a bug deep inside", lambda p: None)
    def _bug(args):
        raise ValueError("shape mismatch deep inside a forward")

    return commands


def test_user_errors_are_one_line_by_default(capsys):
    def marked():
        with user_input():
            raise ValueError("--data x.jsonl:2: not valid JSON")

    assert run_cli("prog", marked) == 2
    assert capsys.readouterr().err == "prog: error: --data x.jsonl:2: not valid JSON\n"
    assert _commands().main(["bad", "--lr", "-1"]) == 2
    assert capsys.readouterr().err == "prog: error: --lr must be >= 0, got -1\n"
    assert _commands().main(["bad", "--lr", "x"]) == 2  # argparse's own one line
    assert "invalid float value" in capsys.readouterr().err


def test_a_value_error_deep_inside_keeps_its_traceback(capsys):
    def deep_bug():
        raise ValueError("shape mismatch deep inside a forward")

    with pytest.raises(ValueError, match="shape mismatch"):
        run_cli("prog", deep_bug)
    with pytest.raises(ValueError, match="shape mismatch"):
        _commands().main(["bug"])
    assert "error:" not in capsys.readouterr().err


def test_a_user_error_is_what_torchruns_summary_reports(tmp_path, monkeypatch, capsys):
    """Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) the error line goes into the worker's error
    file as well, and torchrun's closing summary, built from that file, ends with it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert _commands().main(["bad", "--lr", "-1"]) == 2
    assert capsys.readouterr().err == "prog: error: --lr must be >= 0, got -1\n"
    failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=2, error_file=str(error_file))
    summary = ChildFailedError("prog", {0: failure}).format_msg().strip().splitlines()
    assert summary[-2].strip() == "traceback : prog: error: --lr must be >= 0, got -1", summary


@pytest.mark.parametrize("call", ["run_cli('prog', deep_bug)", "_commands().main(['bug'])"])
def test_a_command_with_a_bug_exits_1_with_the_traceback(call):
    code = textwrap.dedent(f"""
        import sys
        from tests.foundation.test_cli import _commands
        from megatron.common.cli import run_cli

        def deep_bug():
            raise ValueError("shape mismatch deep inside a forward")

        sys.exit({call})
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: shape mismatch deep inside a forward"
    assert "error:" not in proc.stderr


# ------------------------------------------------------------------- several ranks (collectives.agreed)


def _agreed_outcomes(rank, world):
    """What each rank gets from ``agreed`` when one rank fails alone (2 gloo ranks)."""
    from megatron.common.collectives import PeerFailed, agreed

    def fails_on(bad_rank, exc):
        def fn():
            if rank == bad_rank:
                raise exc
            return rank

        return fn

    out = {"own": agreed(lambda: rank * 10), "rank0s": agreed(lambda: {"written": rank}, src=0)}
    for name, fn, kwargs in (
        ("user_on_1", fails_on(1, UserError("--data x.jsonl: no such file")), {}),
        ("user_on_0_alone", fails_on(0, UserError("--out y exists")), {"src": 0}),
        ("bug_on_0", fails_on(0, ValueError("shape mismatch")), {}),
    ):
        try:
            out[name] = ("returned", agreed(fn, **kwargs))
        except UserError as e:
            out[name] = ("UserError", str(e))
        except PeerFailed as e:
            out[name] = ("PeerFailed", str(e))
        except ValueError as e:
            out[name] = ("ValueError", str(e))
    return out


def test_agreed_makes_every_rank_fail_with_the_real_error():
    """A failure on one rank is agreed before any rank goes on: a user error is the same
    ``UserError`` on every rank (rank 0 prints it), a bug keeps its own exception on the rank that
    raised it and is ``PeerFailed`` naming it on the others; results come back as they were."""
    from tools.spawn import run_distributed

    r0, r1 = run_distributed(_agreed_outcomes, 2)
    assert (r0["own"], r1["own"]) == (0, 10)
    assert r0["rank0s"] == r1["rank0s"] == {"written": 0}
    assert r0["user_on_1"] == ("UserError", "--data x.jsonl: no such file (rank 1)")
    assert r1["user_on_1"] == ("UserError", "--data x.jsonl: no such file")
    assert r0["user_on_0_alone"] == r1["user_on_0_alone"] == ("UserError", "--out y exists")
    assert r0["bug_on_0"] == ("ValueError", "shape mismatch")
    assert r1["bug_on_0"] == ("PeerFailed", "rank 0 failed (ValueError: shape mismatch); its traceback is in its output")


RANK_SCRIPT = """
import os, sys, time
from megatron.common.cli import UserError, run_cli

def body():
    rank = int(os.environ["RANK"])
    if {case!r} == "everywhere":  # every rank raises it; rank 0 a little later
        time.sleep(1.5 if rank == 0 else 0)
        raise UserError("--data x.jsonl: no such file")
    if rank == 1:  # rank 1 alone, unagreed; rank 0 stands in a collective that never returns
        raise UserError("--data x.jsonl: no such file on this node")
    time.sleep(120)

sys.exit(run_cli("prog", body))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case,expected", [
    ("everywhere", "prog: error: --data x.jsonl: no such file"),
    ("rank1", "prog: error: rank 1: --data x.jsonl: no such file on this node"),
])
def test_under_torchrun_the_error_line_is_printed_once_and_never_lost(case, expected, tmp_path):
    """torchrun stops every rank as soon as one exits. A user error every rank raises is printed
    once, by rank 0, even when another rank gets there first; one that rank 1 raised alone is
    printed by rank 1. (Before, rank 1 exited silently at once and torchrun ended rank 0 before it
    printed: no error line at all.) torchrun's closing summary, the last lines, names it too."""
    script = tmp_path / "cmd.py"
    script.write_text(RANK_SCRIPT.format(case=case))
    proc = _torchrun(2, str(script))
    assert proc.returncode != 0
    assert [line for line in proc.stderr.splitlines() if line.startswith("prog: error:")] == [expected], \
        proc.stderr[-3000:]
    assert expected in "\n".join(_last_lines(proc.stderr)), proc.stderr[-3000:]


def _torchrun(nproc: int, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *command], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))


def _last_lines(text: str, n: int = 2) -> list:
    return [line for line in text.splitlines() if line.strip()][-n:]


@pytest.mark.slow
def test_under_torchrun_a_refused_command_ends_the_screen_with_its_error(tmp_path):
    """A refused training command under torchrun: its one-line error is in the last lines on the
    screen (torchrun's closing summary reads it from the worker's error file), not 30 lines above
    them, under torchrun's own traceback and a link to its docs."""
    proc = _torchrun(1, "-m", "megatron.training.pretrain_gpt", "--config", "examples/tiny_moe_cpu.yaml",
                     "--expert-model-parallel-size", "1", "--save-interval", "5")
    expected = "pretrain_gpt: error: --save-interval needs --save DIR"
    assert proc.returncode != 0
    assert [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt: error:")] == [expected]
    assert any(line.endswith(expected) for line in _last_lines(proc.stderr)), proc.stderr[-3000:]
