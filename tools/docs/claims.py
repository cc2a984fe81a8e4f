"""Figures the docs quote, checked against the JSON under docs/figures/ they come from.

A claim is one entry of a YAML list (the project's is ``tests/docs/claims.yaml``)::

    - page: docs/results/netsim.md                        # the page that quotes the figures
      text: "Goal (every pooled figure <= 15%): missed**, by N1's TTFT ({})"
      file: docs/figures/netsim_validation/ooc_report.json
      values:                                              # one [key, format] per {} of text
        - ["configurations[name=N1].figures.ttft_p50_s.pooled", ".1%"]

``text`` is the page's own words with each quoted figure written ``{}`` (runs of whitespace, line
breaks included, count as one space). The claim holds when ``text`` with every ``{}`` replaced by
its value, formatted with Python's format spec (``.1f``, ``.1%``, ``,.0f``, ``+.1%``; ``""`` for a
string), appears on the page: a figure edited by hand, or a JSON written again without its page,
breaks it.

A key is a path into the JSON: keys joined by dots, ``[2]`` a list index, ``[name=N1]`` the element
of a list whose ``name`` is ``N1`` (``[method=semmoe,mode=tp]``: both hold), ``["a.b"]`` a key that
holds a dot, ``*`` every element or value (the key then gives a list). A value may instead be
arithmetic over keys in braces, for a figure the page derives (a ratio, a percentage change,
seconds as milliseconds, a range's end): ``"1 - {variants.farskip.ttft_s.p50} /
{variants.standard.ttft_s.p50}"``, ``"min({rows[*].lar})"``; ``min``, ``max``, ``median``, ``abs``
and ``len`` may be called, and ``{FILE::key}`` reads another file. ``file`` is relative to the
repository root; ``.json.gz`` files are read gunzipped; any other file is text, and its keys are
regular expressions (no braces) whose first group is read at every match (a number where it parses
as one; a list when there are several). A value's optional third element names its own file.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
import operator
import re
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

__all__ = ["Claim", "ClaimError", "load_claims", "resolve", "evaluate", "check_claims", "placeholder_spans",
           "normal_page"]

PLACEHOLDER = "{}"
# a figure as the pages write it: sign, digits with thousands commas, decimals, exponent, percent
_FIGURE = r"([-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?%?)"
_EXPR_KEY = re.compile(r"\{([^{}]+)\}")
_STEP = re.compile(r"""\[\s*(?:"([^"]*)"|'([^']*)'|(-?\d+)|(\*)|([^\]]*=[^\]]*))\s*\]""")
ALL = object()  # the ``*`` step


class ClaimError(ValueError):
    """A claim that does not hold, or that cannot be read (its message says which)."""


@dataclasses.dataclass(frozen=True)
class Claim:
    page: str
    text: str
    file: str
    values: tuple  # of (key or expression, format spec, file or None)
    index: int = 0  # the entry's position in its YAML list


def load_claims(path: Path) -> list[Claim]:
    """The entries of a claims YAML file; a malformed entry is a ``ClaimError`` naming it."""
    try:
        entries = yaml.safe_load(Path(path).read_text()) or []
    except yaml.YAMLError as e:
        raise ClaimError(f"{path}: not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(entries, list):
        raise ClaimError(f"{path}: expected a YAML list of claims")
    claims = []
    for i, e in enumerate(entries):
        where = f"{path}: entry {i}"
        if not isinstance(e, dict) or not {"page", "text", "file", "values"} <= set(e):
            raise ClaimError(f"{where}: needs page, text, file and values")
        values = []
        for v in e["values"]:
            if not isinstance(v, list) or len(v) not in (2, 3):
                raise ClaimError(f"{where}: each value is [key, format] or [key, format, file], not {v!r}")
            values.append((str(v[0]), str(v[1] if v[1] is not None else ""), v[2] if len(v) == 3 else None))
        if e["text"].count(PLACEHOLDER) != len(values):
            raise ClaimError(f"{where}: text has {e['text'].count(PLACEHOLDER)} {{}} for {len(values)} values")
        claims.append(Claim(e["page"], e["text"], e["file"], tuple(values), i))
    return claims


def _steps(key: str) -> list:
    """``a.b[2][name=x]["c.d"]`` -> ['a', 'b', 2, (('name', 'x'),), 'c.d']."""
    steps: list = []
    pos = 0
    while pos < len(key):
        if key[pos] == ".":
            pos += 1
            continue
        if key[pos] == "[":
            m = _STEP.match(key, pos)
            if not m:
                raise ClaimError(f"key {key!r}: bad [...] at position {pos}")
            dq, sq, index, star, select = m.groups()
            if index is not None:
                steps.append(int(index))
            elif star is not None:
                steps.append(ALL)
            elif select is not None:
                pairs = [c.split("=", 1) for c in re.split(r",(?=\s*[\w.-]+\s*=)", select)]
                if any(len(pair) != 2 for pair in pairs):
                    raise ClaimError(f"key {key!r}: a selector is [field=value] or [field=value,field=value]")
                steps.append(tuple((f.strip(), v.strip()) for f, v in pairs))
            else:
                steps.append(dq if dq is not None else sq)
            pos = m.end()
            continue
        end = len(key)
        for stop in ".[":
            found = key.find(stop, pos)
            if found != -1:
                end = min(end, found)
        steps.append(ALL if key[pos:end] == "*" else key[pos:end])
        pos = end
    return steps


def _number(text: str) -> Any:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def _search(text: str, key: str) -> Any:
    """A text file's key: the first group of every match of the regular expression ``key``."""
    try:
        pattern = re.compile(key, re.MULTILINE)
    except re.error as e:
        raise ClaimError(f"key {key!r}: {e}") from None
    if pattern.groups < 1:
        raise ClaimError(f"key {key!r}: a text file's key needs a (group) around the figure")
    found = [_number(m.group(1)) for m in pattern.finditer(text)]
    if not found:
        raise ClaimError(f"key {key!r}: no match in the file")
    return found[0] if len(found) == 1 else found


def resolve(data: Any, key: str) -> Any:
    """The value at ``key`` (see the module docstring) in parsed JSON ``data`` (a text file's text: a
    regular expression)."""
    if isinstance(data, str):
        return _search(data, key)
    return _walk(data, _steps(key), key)


def _walk(node: Any, steps: list, key: str) -> Any:
    for i, step in enumerate(steps):
        if step is ALL:
            items = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else None
            if not items:
                raise ClaimError(f"key {key!r}: nothing for * to take")
            out: list = []
            for item in items:
                value = _walk(item, steps[i + 1:], key)
                out.extend(value if isinstance(value, list) and ALL in steps[i + 1:] else [value])
            return out
        if isinstance(step, tuple):
            matches = [x for x in node if isinstance(x, dict) and all(str(x.get(f)) == v for f, v in step)] \
                if isinstance(node, list) else []  # fmt: skip
            if len(matches) != 1:
                wanted = ", ".join(f"{f} = {v!r}" for f, v in step)
                raise ClaimError(f"key {key!r}: {len(matches)} elements with {wanted}")
            node = matches[0]
        elif isinstance(step, int):
            if not isinstance(node, list) or not -len(node) <= step < len(node):
                raise ClaimError(f"key {key!r}: no element [{step}]")
            node = node[step]
        else:
            if not isinstance(node, dict) or step not in node:
                raise ClaimError(f"key {key!r}: no {step!r}"
                                 + (f" (has {', '.join(map(str, list(node)[:12]))})" if isinstance(node, dict) else ""))
            node = node[step]
    return node


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_CALLS = {"min": min, "max": max, "abs": abs, "len": len, "median": statistics.median}


def _arith(node: ast.AST, names: dict) -> float:
    if isinstance(node, ast.Expression):
        return _arith(node.body, names)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_arith(node.left, names), _arith(node.right, names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand, names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS and not node.keywords:
        return _CALLS[node.func.id](*(_arith(a, names) for a in node.args))
    raise ClaimError(f"expression: {ast.unparse(node)!r} is not arithmetic on keys")


def evaluate(data: Any, key_or_expr: str, load: Optional[Callable[[str], Any]] = None) -> Any:
    """A key's value, or an arithmetic expression over ``{key}``s; ``{FILE::key}`` reads another file
    through ``load`` (a figure taken over several runs' files)."""
    if "{" not in key_or_expr:
        return resolve(data, key_or_expr)
    names: dict = {}

    def name(m: re.Match) -> str:
        file, sep, key = m.group(1).rpartition("::")
        if sep and load is None:
            raise ClaimError(f"expression {key_or_expr!r}: no other file can be read here")
        names[f"_k{len(names)}"] = resolve(load(file) if sep else data, key)
        return f"_k{len(names) - 1}"

    source = _EXPR_KEY.sub(name, key_or_expr)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise ClaimError(f"expression {key_or_expr!r}: {e.msg}") from None
    return _arith(tree, names)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class _Reader:
    """Pages and JSON files, each read once."""

    def __init__(self, repo: Path):
        self.repo = repo
        self._pages: dict = {}
        self._files: dict = {}

    def page(self, rel: str) -> str:
        if rel not in self._pages:
            path = self.repo / rel
            if not path.is_file():
                raise ClaimError(f"no page {rel}")
            self._pages[rel] = _normal(path.read_text())
        return self._pages[rel]

    def data(self, rel: str) -> Any:
        """A JSON file parsed (``.json``, ``.json.gz``), any other file as text."""
        if rel not in self._files:
            path = self.repo / rel
            if not path.is_file():
                raise ClaimError(f"no file {rel}")
            opener = gzip.open if rel.endswith(".gz") else open
            with opener(path, "rt") as f:
                self._files[rel] = json.load(f) if rel.endswith((".json", ".json.gz")) else f.read()
        return self._files[rel]


def _format(value: Any, spec: str, key: str) -> str:
    try:
        return format(value, spec)
    except (TypeError, ValueError) as e:
        raise ClaimError(f"{key!r} = {value!r} cannot be formatted with {spec!r}: {e}") from None


def _pattern(template: str) -> re.Pattern:
    parts = _normal(template).split(PLACEHOLDER)
    return re.compile(_FIGURE.join(re.escape(p) for p in parts))


def check_claim(claim: Claim, reader: _Reader) -> None:
    """Raise ``ClaimError`` unless the page quotes every figure of ``claim`` as its JSON gives it."""
    page = reader.page(claim.page)
    expected = []
    for key, spec, file in claim.values:
        data = reader.data(file or claim.file)
        expected.append(_format(evaluate(data, key, reader.data), spec, key))
    template = _normal(claim.text)
    rendered = template
    for figure in expected:
        rendered = rendered.replace(PLACEHOLDER, figure, 1)
    if rendered in page:
        return
    m = _pattern(template).search(page)
    if m is None:
        raise ClaimError(f"{claim.page}: no text matches {template!r} (the sentence changed: edit the claim)")
    wrong = [f"{got} where {file or claim.file} gives {want} ({key})"
             for got, want, (key, _, file) in zip(m.groups(), expected, claim.values) if got != want]  # fmt: skip
    raise ClaimError(f"{claim.page}: {'; '.join(wrong) or 'figures differ'} in {m.group(0)!r}")


def check_claims(repo: Path, claims: list[Claim]) -> list[tuple[Claim, str]]:
    """Every claim that does not hold, with why."""
    reader = _Reader(repo)
    failed = []
    for claim in claims:
        try:
            check_claim(claim, reader)
        except ClaimError as e:
            failed.append((claim, str(e)))
    return failed


def placeholder_spans(repo: Path, claims: list[Claim], page: str) -> list[tuple[int, int]]:
    """Where on ``page`` (whitespace-normalised text) the claims' figures sit, as (start, end)."""
    text = _Reader(repo).page(page)
    spans = []
    for claim in claims:
        if claim.page != page:
            continue
        for m in _pattern(claim.text).finditer(text):
            spans.extend(m.span(g) for g in range(1, (m.lastindex or 0) + 1))
    return spans


def normal_page(repo: Path, page: str) -> str:
    """``page``'s text as claims see it (runs of whitespace as one space)."""
    return _Reader(repo).page(page)
