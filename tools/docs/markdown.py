"""Markdown as the docs tools read it: fenced blocks, headings and their anchors, links.

Only what the checks need, not a renderer: lines inside fenced code blocks are code (a ``# comment``
in a bash block is no heading, a ``[x](y)`` there no link); inline code spans are blanked before
links and words are looked for.
"""

from __future__ import annotations

import dataclasses
import html
import re
import unicodedata
from typing import Callable, Iterator

__all__ = ["Fence", "lines", "fences", "blank_code_spans", "prose_lines", "headings", "anchors", "slug_mkdocs", "slug_github", "links",
           "SLUGS"]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`]*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
_HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*\"([^\"]*)\"")
_HTML_ID = re.compile(r"\b(?:id|name)\s*=\s*\"([^\"]+)\"")
_TAG = re.compile(r"<[^>]+>")


@dataclasses.dataclass(frozen=True)
class Fence:
    """A fenced code block: the line of its opening fence (1-based), its info string (``bash``)
    and its text."""

    line: int
    info: str
    text: str


def lines(text: str) -> Iterator[tuple[int, str, str, str]]:
    """(line number, line, kind, info string of the open fence); kind is ``text``, or ``open``,
    ``code``, ``close`` for a fenced block's lines (an unclosed fence runs to the end)."""
    fence, info = None, ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, info = m.group(1), m.group(2).strip()
            yield number, line, "open", info
        elif fence is None:
            yield number, line, "text", ""
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = None
            yield number, line, "close", info
        else:
            yield number, line, "code", info


def fences(text: str) -> list[Fence]:
    """Every fenced code block, in order."""
    out, start, info, body = [], 0, "", []
    for number, line, kind, fence_info in lines(text):
        if kind == "open":
            start, info, body = number, fence_info, []
        elif kind == "code":
            body.append(line + "\n")
        elif kind == "close":
            out.append(Fence(start, info, "".join(body)))
            start = 0
    if start:
        out.append(Fence(start, info, "".join(body)))
    return out


def blank_code_spans(line: str) -> str:
    """``line`` with its inline code spans turned to spaces (columns kept)."""
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced blocks, inline code spans blanked out."""
    for number, line, kind, _ in lines(text):
        if kind == "text":
            yield number, blank_code_spans(line)


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line number, level, text) of every ATX heading outside fenced blocks."""
    out = []
    for number, line, kind, _ in lines(text):
        m = _HEADING.match(line) if kind == "text" else None
        if m:
            out.append((number, len(m.group(1)), (m.group(2) or "").strip()))
    return out


def _plain(title: str) -> str:
    """A heading's text as rendered: code spans keep their content, links their text, markup and
    tags go."""
    title = _CODE_SPAN.sub(lambda m: m.group(2).strip(), title)
    title = _INLINE_LINK.sub(lambda m: m.group(1), title)
    title = _TAG.sub("", title)
    title = re.sub(r"(\*{1,3})(\S.*?\S|\S)\1", r"\2", title)
    return html.unescape(title)


def slug_mkdocs(title: str) -> str:
    """Python-Markdown's ``toc`` slug (what mkdocs gives a heading's anchor)."""
    text = unicodedata.normalize("NFKD", _plain(title)).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def slug_github(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, each space a ``-``."""
    text = _plain(title).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _dedupe_mkdocs(slug: str, seen: set) -> str:
    while slug in seen or not slug:
        m = re.match(r"^(.*)_([0-9]+)$", slug)
        slug = f"{m.group(1)}_{int(m.group(2)) + 1}" if m else f"{slug}_1"
    return slug


def _dedupe_github(slug: str, seen: set) -> str:
    base, n = slug, 0
    while slug in seen:
        n += 1
        slug = f"{base}-{n}"
    return slug


# the renderer a page is read with -> (slug, how a repeated heading's anchor is told apart)
SLUGS: dict[str, tuple[Callable[[str], str], Callable[[str, set], str]]] = {
    "mkdocs": (slug_mkdocs, _dedupe_mkdocs),
    "github": (slug_github, _dedupe_github),
}


def anchors(text: str, renderer: str) -> set:
    """Every anchor a page has under ``renderer`` (``mkdocs`` or ``github``): its headings' slugs
    and the ``id``/``name`` attributes of its HTML."""
    slug, dedupe = SLUGS[renderer]
    seen: set = set()
    for _, _, title in headings(text):
        seen.add(dedupe(slug(title), seen))
    for _, line in prose_lines(text):
        seen.update(_HTML_ID.findall(line))
    return seen


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link and image outside code: inline, reference definitions
    and HTML ``href``/``src``."""
    for number, line in prose_lines(text):
        for m in _INLINE_LINK.finditer(line):
            yield number, m.group(2)
        m = _REF_DEF.match(line)
        if m:
            yield number, m.group(1)
        for target in _HTML_LINK.findall(line):
            yield number, target
