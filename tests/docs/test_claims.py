"""The docs' quoted figures against the JSON they come from (``tests/docs/claims.yaml``, read by
``tools/docs/claims.py``): a figure edited by hand, or a JSON written again without its page, fails
here. Exact: each figure must equal its JSON value formatted as the entry says (the rounding is the
tolerance, stated per entry).

To add a figure: copy the page's sentence or table row into ``claims.yaml`` with the figure written
``{}``, and give the JSON file, the key and the format (the module docstring of
``tools/docs/claims.py`` has the key syntax).
"""

import json
import re
from pathlib import Path

import pytest

from tools import repo_root
from tools.docs.claims import ClaimError, check_claims, evaluate, load_claims, normal_page, placeholder_spans, resolve

REPO = Path(repo_root())
CLAIMS = REPO / "tests" / "docs" / "claims.yaml"
_ALL = load_claims(CLAIMS)


def test_every_quoted_figure_equals_its_json():
    """Every entry of claims.yaml at once, so that one run lists every figure that is off."""
    failed = check_claims(REPO, _ALL)
    assert not failed, "\n".join(f"{CLAIMS.name} entry {claim.index}: {why}" for claim, why in failed)


# README's results table: every number in a row is a checked figure, except these words, which
# name a configuration rather than report a measurement
README_CONFIGURATION = ("EP 4", "EP 2 and", "top-12 routing", "0.03 Gbit/s", "3 runs each", "of 10 steps", "2-rank server", "at sequence 1024",
                        "95% bootstrap", "at batch 32")
_NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?!\w|\.\d)")


def test_every_figure_of_the_readme_results_table_is_checked():
    """Each number in a row of README.md's results table lies in a claim's ``{}`` (or in a
    configuration phrase listed above); the link targets are not figures."""
    text = normal_page(REPO, "README.md")
    table = text[text.index("| topic | what is measured | page |"):text.index("## Where things are")]
    start = text.index(table)
    spans = placeholder_spans(REPO, _ALL, "README.md")
    exempt = [(m.start(), m.end()) for phrase in README_CONFIGURATION for m in re.finditer(re.escape(phrase), text)]
    unchecked = []
    for m in _NUMBER.finditer(re.sub(r"\]\([^)]*\)", lambda x: " " * len(x.group(0)), table)):
        a, b = start + m.start(), start + m.end()
        if not any(s <= a and b <= e for s, e in spans + exempt):
            unchecked.append(text[max(a - 30, 0):b + 10])
    assert not unchecked, f"README results figures with no claim in {CLAIMS.name}: {unchecked}"


def _page(tmp_path, text: str, data: dict):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text(text)
    (tmp_path / "f.json").write_text(json.dumps(data))
    claims = tmp_path / "claims.yaml"
    claims.write_text('- {page: docs/p.md, text: "served {} of {} requests, TTFT {} ms", file: f.json,\n'
                      '   values: [[summary.served, d], [summary.requests, ",d"], ["{ttft_s} * 1000", .0f]]}\n')
    return load_claims(claims)


def test_a_figure_edited_on_the_page_fails(tmp_path):
    """The check itself: the page's figures must equal the JSON's at the entry's format, whitespace
    and line breaks aside; one digit changed by hand fails and names the figure and the key."""
    data = {"summary": {"served": 478, "requests": 1585}, "ttft_s": 0.1234}
    claims = _page(tmp_path, "We served 478 of 1,585\nrequests, TTFT 123 ms.", data)
    assert check_claims(tmp_path, claims) == []
    (tmp_path / "docs" / "p.md").write_text("We served 487 of 1,585 requests, TTFT 123 ms.")
    [(_, why)] = check_claims(tmp_path, claims)
    assert "487 where f.json gives 478 (summary.served)" in why


def test_a_json_written_again_fails_and_a_changed_sentence_is_named(tmp_path):
    claims = _page(tmp_path, "served 478 of 1,585 requests, TTFT 123 ms", {"summary": {"served": 478, "requests": 1585},
                                                                        "ttft_s": 0.1299})  # fmt: skip
    [(_, why)] = check_claims(tmp_path, claims)
    assert "123 where f.json gives 130" in why
    (tmp_path / "docs" / "p.md").write_text("478 of 1,585 requests were served")
    [(_, why)] = check_claims(tmp_path, claims)
    assert "no text matches" in why


def test_keys_selectors_wildcards_and_expressions():
    data = {"rows": [{"name": "N1", "v": {"a.b": 2.0}}, {"name": "N2", "v": {"a.b": 5.0}}], "x": [1, 2, 3]}
    assert resolve(data, 'rows[name=N2].v["a.b"]') == 5.0
    assert resolve(data, "x[-1]") == 3
    assert resolve(data, 'rows[*].v["a.b"]') == [2.0, 5.0]
    assert evaluate(data, 'max({rows[*].v["a.b"]}) / {x[1]} - len({x})') == -0.5
    assert resolve("a 1.5%\nb 2,048 tok/s\na 3.0%", r"^a ([\d.]+)%") == [1.5, 3.0]
    assert resolve("b 2,048 tok/s", r"b ([\d,]+) tok") == 2048.0
    for bad in ("rows[name=N3].v", "rows[0].w", "x[7]"):
        with pytest.raises(ClaimError):
            resolve(data, bad)
    with pytest.raises(ClaimError, match="not arithmetic"):
        evaluate(data, "__import__('os') + {x[0]}")


def test_entries_are_well_formed(tmp_path):
    bad = tmp_path / "claims.yaml"
    bad.write_text('- {page: README.md, text: "a {} b {}", file: f.json, values: [[k, .1f]]}\n')
    with pytest.raises(ClaimError, match="2 {} for 1 values"):
        load_claims(bad)
