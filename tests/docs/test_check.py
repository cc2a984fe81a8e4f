"""``python -m tools.docs check``: each kind of problem is caught on a small fixture tree with its
file and line, a clean tree passes, the heading anchors agree with Python-Markdown's (what mkdocs
renders), and the real README.md and docs/ pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools.docs import markdown
from tools.docs.check import PAGE_LIMIT, README_LIMIT, check_tree

ROOT = Path(__file__).resolve().parents[2]

CLEAN = {
    "README.md": "# Project\n\nSee [serving](docs/guides/serve.md#start-a-server) and the "
                 "[results](docs/results/serving.md).\n",
    "docs/guides/serve.md": (
        "# Serve a checkpoint\n\n"
        "## Start a server\n\n"
        "Run `python -m megatron.inference.serve` (a `session` in code is not prose).\n\n"
        "<!-- ci: run timeout=60 -->\n"
        "```bash\n"
        "# a comment, not a heading; [not](a-link.md); the session id\n"
        "echo hello\n"
        "```\n\n"
        "## The `--port` flag: 0 picks one\n\n"
        "See [the table](../results/serving.md#throughput-range-of-3-runs), "
        "[the port](#the-port-flag-0-picks-one) and the [data](../figures/run.json).\n"
    ),
    "docs/results/serving.md": "# Serving\n\n## Throughput (range of 3 runs)\n\nFrom [the JSON](../figures/run.json).\n",
    "docs/figures/run.json": "{}\n",
    "docs/figures/notes.md": "# Notes\n\nLogged during session 3 on the lent H100 (data, not checked for words).\n",
}


def _tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _problems(tmp_path, changes: dict = None) -> list[str]:
    """The problems of the clean tree with ``changes`` (file -> text) made."""
    return [str(p) for p in check_tree(_tree(tmp_path, {**CLEAN, **(changes or {})}))]


def test_clean_tree_passes(tmp_path):
    assert _problems(tmp_path) == []


def test_broken_link_is_caught_with_its_line(tmp_path):
    page = CLEAN["docs/results/serving.md"] + "\nAnd [gone](../guides/missing.md).\n"
    problems = _problems(tmp_path, {"docs/results/serving.md": page})
    assert problems == ["docs/results/serving.md:7: broken link ../guides/missing.md: no such file "
                        "docs/guides/missing.md"]


def test_bad_anchor_is_caught(tmp_path):
    readme = "# Project\n\n[serving](docs/guides/serve.md#no-such-heading)\n"
    problems = _problems(tmp_path, {"README.md": readme})
    assert problems == ["README.md:3: broken anchor docs/guides/serve.md#no-such-heading: docs/guides/serve.md "
                        "has no heading with the anchor #no-such-heading"]


def test_same_page_anchor_is_checked(tmp_path):
    page = CLEAN["docs/results/serving.md"] + "\n[up](#throughput-range-of-3-runs) [bad](#throughput)\n"
    problems = _problems(tmp_path, {"docs/results/serving.md": page})
    assert len(problems) == 1 and "#throughput:" in problems[0] and ":7:" in problems[0]


def test_link_out_of_docs_is_caught(tmp_path):
    files = dict(CLEAN, **{"examples/tiny.yaml": "a: 1\n"})
    files["docs/results/serving.md"] += "\nThe [config](../../examples/tiny.yaml).\n"
    problems = [str(p) for p in check_tree(_tree(tmp_path, files))]
    assert len(problems) == 1 and "leaves docs/" in problems[0] and "examples/tiny.yaml" in problems[0]


def test_link_to_a_folder_is_caught_in_docs_only(tmp_path):
    changes = {"README.md": CLEAN["README.md"] + "\nThe [figures](docs/figures/).\n",
               "docs/results/serving.md": CLEAN["docs/results/serving.md"] + "\nThe [figures](../figures/).\n"}
    problems = _problems(tmp_path, changes)
    assert len(problems) == 1 and problems[0].startswith("docs/results/serving.md:7: link ../figures/ is a folder")


@pytest.mark.parametrize("sentence", [
    "This was measured in session 3.",
    "Measured over two sessions.",
    "Run on the lent H100.",
    "We borrowed a GPU machine for it.",
    "It used 14 minutes of device time.",
    "See ticket 12.",
    "Fixed in issue #30.",
    "as issue 29 asked",
    "the replay/5 model",
    "An earlier version of this page said otherwise.",
    "Before this change the loop copied.",
    "In this round we added it.",
    "during the second working period",
    "The default was changed to 4.",
])
def test_history_words_are_caught(tmp_path, sentence):
    page = CLEAN["docs/results/serving.md"] + f"\n{sentence}\n"
    problems = _problems(tmp_path, {"docs/results/serving.md": page})
    assert len(problems) == 1 and problems[0].startswith("docs/results/serving.md:7: history word"), problems


@pytest.mark.parametrize("sentence", [
    "The replay model (`MODEL_VERSION` replay/7) predicts it.",
    "Each request is a chat with a system prompt.",
    "The issue is that the queue fills.",
    "It borrowed the idea from vLLM.",
])
def test_ordinary_prose_passes(tmp_path, sentence):
    page = CLEAN["docs/results/serving.md"] + f"\n{sentence}\n"
    assert _problems(tmp_path, {"docs/results/serving.md": page}) == []


def test_architecture_and_conventions_are_checked(tmp_path):
    files = dict(CLEAN, **{"docs/CONVENTIONS.md": "# Conventions\n\nAgreed in session 2.\n"})
    problems = [str(p) for p in check_tree(_tree(tmp_path, files))]
    assert problems and problems[0].startswith("docs/CONVENTIONS.md:3: history word")


def test_oversized_pages_are_caught(tmp_path):
    files = dict(CLEAN)
    files["README.md"] += "x" * README_LIMIT
    files["docs/results/serving.md"] += "y" * PAGE_LIMIT
    problems = [str(p) for p in check_tree(_tree(tmp_path, files))]
    assert [p.split(":")[0] for p in problems] == ["README.md", "docs/results/serving.md"]
    assert all("KiB a page may have" in p for p in problems)


def test_ci_markers_must_mark_a_bash_block_in_a_guide(tmp_path):
    guide = CLEAN["docs/guides/serve.md"] + "\n<!-- ci: run -->\n\n```bash\necho a gap\n```\n<!-- ci: run timeout=x -->\n"
    result = CLEAN["docs/results/serving.md"] + "\n<!-- ci: run -->\n```bash\necho never run\n```\n"
    problems = _problems(tmp_path, {"docs/guides/serve.md": guide, "docs/results/serving.md": result})
    assert len(problems) == 3
    assert "docs/guides/serve.md:17: CI marker not followed" in problems[0]
    assert "docs/guides/serve.md:22: malformed CI marker" in problems[1]
    assert "docs/results/serving.md:7: CI marker outside docs/guides/" in problems[2]


HEADINGS = [
    "3. Compute times (`netsim/compute.py`, `netsim/model.py`)",
    "Serve a checkpoint",
    "The `--port` flag: 0 picks one",
    "Throughput -- range of 3 runs",
    "FarSkip's connectivity vs. the authors' reference",
    "**Bold** and [a link](x.md) in a heading",
    "Serve a checkpoint",
    "Écart & ümlaut <b>tag</b>",
]


def test_mkdocs_anchors_match_python_markdown():
    """The anchors the check accepts for a docs/ page are the ids Python-Markdown's toc (what mkdocs
    builds with) gives the same headings, repeated headings included."""
    md = pytest.importorskip("markdown")
    text = "".join(f"## {h}\n\ntext\n\n" for h in HEADINGS)
    renderer = md.Markdown(extensions=["toc"])
    renderer.convert(text)

    def ids(tokens):
        return [t["id"] for token in tokens for t in [token] + list(_flat(token["children"]))]

    expected = set(ids(renderer.toc_tokens))
    assert markdown.anchors(text, "mkdocs") == expected


def _flat(tokens):
    for token in tokens:
        yield token
        yield from _flat(token["children"])


def test_github_anchors():
    assert markdown.slug_github("Throughput -- range of 3 runs") == "throughput----range-of-3-runs"
    assert markdown.slug_mkdocs("Throughput -- range of 3 runs") == "throughput-range-of-3-runs"
    text = "# Serve\n\n## Serve\n"
    assert markdown.anchors(text, "github") == {"serve", "serve-1"}
    assert markdown.anchors(text, "mkdocs") == {"serve", "serve_1"}


def test_command_prints_one_line_a_problem_and_fails(tmp_path):
    files = dict(CLEAN)
    files["docs/results/serving.md"] += "\n[gone](nowhere.md) in session 4\n"
    _tree(tmp_path, files)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tools.docs", "check", "--repo", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines() == [
        "docs/results/serving.md:7: broken link nowhere.md: no such file docs/results/nowhere.md",
        "docs/results/serving.md:7: history word 'session' (a session): say what the software does",
    ]


def test_real_docs_pass():
    """README.md and every docs/ page of this checkout (what `make check-docs` runs)."""
    problems = check_tree(ROOT)
    assert not problems, "\n".join(str(p) for p in problems)


def _mkdocs_strict(root: Path) -> subprocess.CompletedProcess:
    """The project's mkdocs.yml without its nav, which names the real pages, not this tree's."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.pop("nav", None)
    config.pop("not_in_nav", None)
    (root / "mkdocs.yml").write_text(yaml.safe_dump(config))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(root / "site")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("broken", [
    "[gone](../guides/missing.md)",
    "[anchor](../guides/serve.md#no-such-heading)",
    "[folder](../figures/)",
    "[outside](../../examples/tiny.yaml)",
])
def test_site_build_agrees(tmp_path, broken):
    """The site (mkdocs.yml, `mkdocs build --strict`) builds the clean tree, and refuses each broken
    link the check catches: a tree the check passes is one the site builds."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    files = {**CLEAN, "examples/tiny.yaml": "a: 1\n"}
    clean = _tree(tmp_path / "clean", files)
    assert check_tree(clean) == []
    built = _mkdocs_strict(clean)
    assert built.returncode == 0, built.stderr
    bad = _tree(tmp_path / "bad", {**files, "docs/results/serving.md": CLEAN["docs/results/serving.md"] + broken + "\n"})
    assert len(check_tree(bad)) == 1
    refused = _mkdocs_strict(bad)
    assert refused.returncode != 0 and "serving.md" in refused.stderr, refused.stderr


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return [p for item in node for p in _nav_pages(item)]


def test_every_page_is_in_the_nav_or_kept_out():
    """mkdocs.yml's nav names pages that exist, and every page under docs/ is in it or under a
    `not_in_nav` folder (the site's sidebar is the reader's way in; `make docs --strict` refuses the
    same, this names the page)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    docs = ROOT / "docs"
    assert [p for p in nav if not (docs / p).is_file()] == []
    kept_out = [line.strip().strip("/") + "/" for line in config.get("not_in_nav", "").splitlines() if line.strip()]
    pages = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    missing = [p for p in pages if p not in nav and not any(p.startswith(k) for k in kept_out)]
    assert missing == [], f"pages in neither mkdocs.yml's nav nor not_in_nav: {missing}"
