"""``python -m tools.docs check``: what makes README.md and docs/**/*.md wrong, one line a problem.

* a relative link whose file does not exist, or whose ``#anchor`` names no heading of the page it
  points to (mkdocs' slugs for docs/ pages, which the site is built with; GitHub's from README.md,
  which GitHub renders); a docs/ page linking out of docs/ (the site has no such page: name the file
  as a ``code`` path) or to a folder; an absolute path;
* words that tell how the work was organised or how a page changed (``FORBIDDEN``) rather than what
  the software does, in prose (code blocks and spans are left alone); data under docs/figures/ is
  not checked for them;
* a page over ``PAGE_LIMIT`` bytes (README.md: ``README_LIMIT``);
* a CI marker (``<!-- ci: run -->``) that marks no ```bash block, or sits outside docs/guides/.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from urllib.parse import unquote

from tools.docs import guides, markdown

__all__ = ["Problem", "FORBIDDEN", "PAGE_LIMIT", "README_LIMIT", "doc_files", "check_tree"]

PAGE_LIMIT = 25 * 1024
README_LIMIT = 12 * 1024
WORDS_EXEMPT = ("docs/figures/",)  # data: logs and run summaries, as their tools wrote them

_MACHINE = r"(?:machines?|GPUs?|H100s?|H200s?|devices?|accelerators?|boxe?s?)"
# (pattern, what it is); matched case-insensitively on prose
FORBIDDEN = [
    (r"\bsessions?\b", "a session"),
    (r"\bworking periods?\b", "a working period"),
    (rf"\b(?:lent|borrowed)\s+(?:(?:an?|the|one|two)\s+)?(?:\w+\s+)?{_MACHINE}\b", "a lent or borrowed machine"),
    (r"\bdevice[- ]time\b", "device time"),
    (r"\btickets?\b", "a ticket"),
    (r"\bissues?\s*#?\d+", "an issue number"),
    (r"\breplay/[2-6]\b", "an old replay model version"),
    (r"\bearlier versions?\b", "an earlier version"),
    (r"\bbefore this change\b", "'before this change'"),
    (r"\bthis round\b", "'this round'"),
    (r"\bwas changed\b", "'was changed'"),
]
_FORBIDDEN = [(re.compile(p, re.IGNORECASE), what) for p, what in FORBIDDEN]
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


@dataclasses.dataclass(frozen=True)
class Problem:
    path: str  # relative to the repository root
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def doc_files(repo: Path) -> list[Path]:
    """README.md and every .md under docs/."""
    readme = [repo / "README.md"] if (repo / "README.md").is_file() else []
    return readme + sorted(p for p in (repo / "docs").rglob("*.md") if p.is_file())


def _rel(repo: Path, path: Path) -> str:
    return Path(os.path.relpath(path, repo)).as_posix()


class _Anchors:
    """The anchors of each page, read once."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, path: Path, renderer: str) -> set:
        key = (path, renderer)
        if key not in self._cache:
            self._cache[key] = markdown.anchors(path.read_text(errors="replace"), renderer)
        return self._cache[key]


def _link_problems(repo: Path, path: Path, text: str, anchors: _Anchors) -> list[Problem]:
    rel = _rel(repo, path)
    docs = (repo / "docs").resolve()
    in_docs = path.resolve().is_relative_to(docs)
    renderer = "mkdocs" if in_docs else "github"
    out = []
    for line, target in markdown.links(text):
        if not target or _SCHEME.match(target):
            continue
        if target.startswith("/"):
            out.append(Problem(rel, line, f"absolute link {target}: use a path relative to this page"))
            continue
        file_part, _, fragment = target.partition("#")
        file_part = unquote(file_part.partition("?")[0])
        dest = Path(os.path.normpath(path.parent / file_part)) if file_part else path
        if not dest.exists():
            out.append(Problem(rel, line, f"broken link {target}: no such file {_rel(repo, dest)}"))
            continue
        if not dest.resolve().is_relative_to(repo.resolve()):
            out.append(Problem(rel, line, f"link {target} leaves the repository"))
            continue
        if in_docs and not dest.resolve().is_relative_to(docs):
            out.append(Problem(rel, line, f"link {target} leaves docs/ (the site has no such page): "
                                          f"name {_rel(repo, dest)} as a `code` path instead"))
            continue
        if in_docs and dest.is_dir():
            out.append(Problem(rel, line, f"link {target} is a folder (the site cannot resolve it): link a page "
                                          "or a file in it"))
            continue
        if fragment and dest.suffix == ".md" and dest.is_file() and unquote(fragment) not in anchors(dest, renderer):
            out.append(Problem(rel, line, f"broken anchor {target}: {_rel(repo, dest)} has no heading "
                                          f"with the anchor #{fragment}"))
    return out


def _word_problems(rel: str, text: str) -> list[Problem]:
    out = []
    for line, prose in markdown.prose_lines(text):
        for pattern, what in _FORBIDDEN:
            m = pattern.search(prose)
            if m:
                out.append(Problem(rel, line, f"history word {m.group(0)!r} ({what}): say what the software does"))
    return out


def check_file(repo: Path, path: Path, anchors: _Anchors | None = None) -> list[Problem]:
    """The problems of one page (``path`` under ``repo``)."""
    rel = _rel(repo, path)
    text = path.read_text(errors="replace")
    out = _link_problems(repo, path, text, anchors or _Anchors())
    if not rel.startswith(WORDS_EXEMPT):
        out += _word_problems(rel, text)
    limit = README_LIMIT if rel == "README.md" else PAGE_LIMIT
    size = path.stat().st_size
    if size > limit:
        out.append(Problem(rel, 1, f"{size} bytes: over the {limit // 1024} KiB a page may have (split it)"))
    blocks, marker_problems = guides.guide_blocks(text)
    out += [Problem(rel, line, what) for line, what in marker_problems]
    if blocks and not rel.startswith(guides.GUIDES + "/"):
        out.append(Problem(rel, blocks[0].line - 1, f"CI marker outside {guides.GUIDES}/: run-guides never runs it"))
    return sorted(out, key=lambda p: p.line)


def check_tree(repo: Path) -> list[Problem]:
    """The problems of README.md and every docs page."""
    anchors = _Anchors()
    return [p for path in doc_files(repo) for p in check_file(repo, path, anchors)]
