"""``python -m tools.docs run-guides``: the marked blocks of a page run in order in a fresh copy of
the repository (tracked files only, ``../shared`` resolving as from the checkout, the venv first on
PATH), a failing or hanging block is reported with its output and ends the page; and every real
guide's blocks pass (slow: one test per page, so that a failing guide names itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.docs.guides import DEFAULT_TIMEOUT_S, guide_blocks, guide_pages, run_page

ROOT = Path(__file__).resolve().parents[2]


def test_blocks_are_the_marked_bash_blocks():
    text = ("# Guide\n\n<!-- ci: run -->\n```bash\necho one\n```\n\n```bash\necho unmarked\n```\n\n"
            "<!-- ci: run timeout=7 -->\n```bash\necho two\necho three\n```\n")
    blocks, problems = guide_blocks(text)
    assert problems == []
    assert [(b.line, b.timeout_s, b.script) for b in blocks] == [
        (4, DEFAULT_TIMEOUT_S, "echo one\n"), (13, 7, "echo two\necho three\n")]


def test_a_marker_named_in_a_code_span_is_no_marker():
    assert guide_blocks("Put `<!-- ci: run -->` before a ```bash block.\n") == ([], [])


def test_a_marker_before_anything_but_a_bash_block_is_a_problem():
    text = "<!-- ci: run -->\n```python\nprint(1)\n```\n<!-- ci: run timeout=0 -->\n```bash\ntrue\n```\n<!-- ci: runs -->\n"
    blocks, problems = guide_blocks(text)
    assert blocks == []
    assert [line for line, _ in problems] == [1, 5, 9]


def _repo(tmp_path: Path, guide: str) -> Path:
    """A git checkout ``tmp/checkout`` with a tracked guide and file, an untracked file, and
    ``tmp/shared/data/x.txt``."""
    repo = tmp_path / "checkout"
    (repo / "docs/guides").mkdir(parents=True)
    (repo / "docs/guides/demo.md").write_text(guide)
    (repo / "tracked.txt").write_text("tracked\n")
    (repo / "untracked.txt").write_text("untracked\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "docs", "tracked.txt"], cwd=repo, check=True)
    (tmp_path / "shared/data").mkdir(parents=True)
    (tmp_path / "shared/data/x.txt").write_text("shared data\n")
    return repo


def test_a_page_runs_in_order_in_a_fresh_copy(tmp_path):
    guide = ("<!-- ci: run -->\n```bash\ncat tracked.txt ../shared/data/x.txt > out.txt\n"
             "test ! -e untracked.txt\nexport GONE=1\n```\n"
             "<!-- ci: run timeout=30 -->\n```bash\ncat out.txt\ntest -z \"${GONE:-}\"\n"
             "python -c 'import os, sys; print(os.environ[\"PYTHONPATH\"] == os.getcwd(), sys.prefix)'\n```\n")
    repo = _repo(tmp_path, guide)
    lines = []
    results = run_page(repo, repo / "docs/guides/demo.md", shared=tmp_path / "shared", report=lines.append)
    assert [r.status for r in results] == ["pass", "pass"], [r.output for r in results]
    assert results[1].output.splitlines()[:2] == ["tracked", "shared data"]
    assert results[1].output.splitlines()[2] == f"True {sys.prefix}"  # the venv that runs the tool: first on PATH
    assert not (repo / "out.txt").exists()  # the checkout itself is untouched
    assert lines[0].startswith("docs/guides/demo.md:2: pass")


def test_a_failing_block_shows_its_output_and_ends_the_page(tmp_path):
    guide = ("<!-- ci: run -->\n```bash\necho before\nfalse\necho after\n```\n"
             "<!-- ci: run -->\n```bash\necho never\n```\n")
    repo = _repo(tmp_path, guide)
    lines = []
    results = run_page(repo, repo / "docs/guides/demo.md", shared=None, report=lines.append)
    assert [r.status for r in results] == ["fail", "skipped"]
    assert results[0].returncode == 1 and results[0].tail() == "before"  # bash -e: 'after' never ran
    text = "\n".join(lines)
    assert "docs/guides/demo.md:2: fail" in text and "exit code 1" in text and "  | before" in text
    assert "docs/guides/demo.md:8: skipped" in text


def test_a_hanging_block_is_stopped_at_its_timeout(tmp_path):
    guide = "<!-- ci: run timeout=1 -->\n```bash\necho started\nsleep 60 &\nsleep 60\n```\n"
    repo = _repo(tmp_path, guide)
    lines = []
    results = run_page(repo, repo / "docs/guides/demo.md", shared=None, report=lines.append)
    assert [r.status for r in results] == ["timeout"]
    assert results[0].tail() == "started" and "no end within 1 s" in "\n".join(lines)


def test_command_line_runs_one_page_and_fails_on_a_failing_block(tmp_path):
    repo = _repo(tmp_path, "<!-- ci: run -->\n```bash\nexit 3\n```\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tools.docs", "run-guides", "--repo", str(repo), "--page", "demo"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "docs/guides/demo.md:2: fail" in out.stdout and "exit code 3" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "tools.docs", "run-guides", "--repo", str(repo), "--page", "nope"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "python -m tools.docs: error: --page nope: no such guide (looked in docs/guides/)")


def _guide(page: Path):
    """A page as a test case, its time limit the sum of its blocks' (plus the copy's time)."""
    limit = sum(b.timeout_s for b in guide_blocks(page.read_text())[0]) + 120
    return pytest.param(page, id=page.stem, marks=pytest.mark.timeout(limit))


@pytest.mark.slow
@pytest.mark.parametrize("page", [_guide(p) for p in guide_pages(ROOT)])
def test_guide(page):
    """The page's marked blocks pass from a fresh copy of this checkout (what CI runs)."""
    results = run_page(ROOT, page, shared=ROOT.parent / "shared")
    if not results:
        pytest.skip(f"{page.name} marks no block for CI")
    failed = [r for r in results if r.status in ("fail", "timeout")]
    assert not failed, "\n\n".join(f"{page.relative_to(ROOT)}:{r.block.line}: {r.status}\n{r.tail()}" for r in failed)
