"""Run the commands the guides mark for CI: ``python -m tools.docs run-guides [--page PAGE]``.

A ```bash block in ``docs/guides/*.md`` runs when the line right before its opening fence is
``<!-- ci: run -->`` or ``<!-- ci: run timeout=N -->`` (seconds; ``DEFAULT_TIMEOUT_S`` otherwise).

Each page runs in a fresh copy of the repository: the files ``git ls-files`` lists, copied from the
working tree into ``TMP/<repo name>/`` with ``TMP/shared`` a symlink to the checkout's
``../shared``, so that ``../shared/data`` resolves from the copy as from the checkout, whatever the
checkout's parent directory holds or allows. Its blocks run in order, each as ``bash -e -o pipefail``
in its own process with the copy's root as working directory, ``PYTHONPATH`` the copy and the
bin directory of the Python that runs this tool (the checkout's ``.venv``) first on ``PATH``: a later
block sees the files an earlier one wrote, not its shell variables. After a failing block the rest
of the page is skipped. The copy is removed afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from megatron.common.cli import UserError

from tools.docs import markdown

__all__ = ["Block", "Result", "DEFAULT_TIMEOUT_S", "GUIDES", "guide_blocks", "guide_pages", "copy_checkout",
           "run_page"]

GUIDES = "docs/guides"
DEFAULT_TIMEOUT_S = 300
TAIL_LINES = 20  # of a failing block's output
PASS_TAIL_LINES = 3  # of a passing one's
MARKER = re.compile(r"^<!--\s*ci:\s*run(?:\s+timeout=(\d+))?\s*-->\s*$")
_MARKER_LIKE = re.compile(r"<!--\s*ci\s*:")


@dataclasses.dataclass(frozen=True)
class Block:
    """A marked block: the line of its opening fence, its time limit and its script."""

    line: int
    timeout_s: int
    script: str


@dataclasses.dataclass(frozen=True)
class Result:
    block: Block
    status: str  # "pass", "fail", "timeout" or "skipped"
    returncode: Optional[int]
    output: str  # stdout and stderr together

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def tail(self, n: int = TAIL_LINES) -> str:
        return "\n".join(self.output.rstrip("\n").splitlines()[-n:])


def guide_blocks(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The marked blocks of a page, and (line, problem) for each marker that marks no ```bash block
    or is malformed."""
    scanned = list(markdown.lines(text))
    blocks, problems = [], []
    for i, (number, line, kind, _) in enumerate(scanned):
        if kind != "text" or not _MARKER_LIKE.search(markdown.blank_code_spans(line)):
            continue
        m = MARKER.match(line.strip())
        if not m:
            problems.append((number, f"malformed CI marker {line.strip()!r} (expected <!-- ci: run --> or "
                                     "<!-- ci: run timeout=N -->)"))
            continue
        following = scanned[i + 1] if i + 1 < len(scanned) else None
        if following is None or following[2] != "open" or following[3].split()[:1] != ["bash"]:
            problems.append((number, "CI marker not followed on the next line by a ```bash block"))
            continue
        timeout = int(m.group(1)) if m.group(1) else DEFAULT_TIMEOUT_S
        if timeout < 1:
            problems.append((number, "CI marker timeout must be at least 1 second"))
            continue
        fence = next(f for f in markdown.fences(text) if f.line == following[0])
        blocks.append(Block(fence.line, timeout, fence.text))
    return blocks, problems


def guide_pages(repo: Path) -> list[Path]:
    return sorted((repo / GUIDES).glob("*.md"))


def copy_checkout(repo: Path, dest: Path, shared: Optional[Path]) -> Path:
    """Copy ``repo``'s tracked files into ``dest/<repo name>`` and link ``dest/shared`` to
    ``shared`` (when it exists); returns the copy's root."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    root = dest / repo.resolve().name
    for name in filter(None, listed.decode().split("\0")):
        source = repo / name
        if not (source.is_file() or source.is_symlink()):  # deleted in the working tree
            continue
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    if shared is not None and shared.is_dir():
        (dest / "shared").symlink_to(shared.resolve(), target_is_directory=True)
    return root


def _run_block(block: Block, cwd: Path, env: dict) -> Result:
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.script], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's whole process group: torchrun, servers
        out, _ = proc.communicate()
        return Result(block, "timeout", None, out.decode(errors="replace"))
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running in the background
    except ProcessLookupError:
        pass
    return Result(block, "pass" if proc.returncode == 0 else "fail", proc.returncode,
                  out.decode(errors="replace"))


def run_page(repo: Path, page: Path, *, shared: Optional[Path], keep: bool = False,
             report: Callable[[str], None] = lambda line: None) -> list[Result]:
    """Run a page's marked blocks in a fresh copy of ``repo``; ``report`` gets a line per block."""
    blocks, problems = guide_blocks(page.read_text())
    rel = page.relative_to(repo) if page.is_relative_to(repo) else page
    if problems:
        raise UserError(f"{rel}:{problems[0][0]}: {problems[0][1]}")
    if not blocks:
        return []
    tmp = Path(tempfile.mkdtemp(prefix="guide."))
    try:
        root = copy_checkout(repo, tmp, shared)
        env = dict(os.environ, PYTHONPATH=str(root),
                   PATH=os.pathsep.join([os.path.join(sys.prefix, "bin"), os.environ.get("PATH", "")]))
        results = []
        for block in blocks:
            if results and not results[-1].ok:
                results.append(Result(block, "skipped", None, ""))
                report(f"{rel}:{block.line}: skipped (an earlier block failed)")
                continue
            started = time.monotonic()
            result = _run_block(block, root, env)
            results.append(result)
            report(f"{rel}:{block.line}: {result.status} ({time.monotonic() - started:.0f} s)")
            if result.ok and result.output.strip():
                report("\n".join("  | " + line for line in result.tail(PASS_TAIL_LINES).splitlines()))
            elif not result.ok:
                what = f"exit code {result.returncode}" if result.status == "fail" else f"no end within {block.timeout_s} s"
                report(f"  {what}; the last lines of its output:\n" +
                       "\n".join("  | " + line for line in result.tail().splitlines()))
        return results
    finally:
        if keep:
            report(f"{rel}: the copy is kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
