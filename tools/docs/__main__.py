"""``python -m tools.docs {check,reference,run-guides,claims}`` (see ``tools/docs/__init__.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.common.cli import Subcommands, UserError

import tools.docs
from tools import repo_root

commands = Subcommands("python -m tools.docs", tools.docs.__doc__.split("\n\n")[0])


def _repo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", type=Path, default=Path(repo_root()), metavar="DIR",
                   help="the checkout whose docs to use (default: the one holding these tools)")


@commands.add("check", "broken links and anchors, history words, oversized pages: one line a problem", _repo)
def _check(args) -> int:
    from tools.docs.check import check_tree

    problems = check_tree(args.repo)
    for problem in problems:
        print(problem)
    print(f"python -m tools.docs check: {len(problems) or 'no'} problem{'' if len(problems) == 1 else 's'}",
          file=sys.stderr)
    return 1 if problems else 0


def _configure_claims(p: argparse.ArgumentParser) -> None:
    _repo(p)
    p.add_argument("--claims", type=Path, metavar="YAML",
                   help="the claims to check (default: REPO/tests/docs/claims.yaml)")


@commands.add("claims", "the figures the docs quote against their JSON (tests/docs/claims.yaml): one line a mismatch",
              _configure_claims)
def _claims(args) -> int:
    from tools.docs.claims import ClaimError, check_claims, load_claims

    path = args.claims or args.repo / "tests" / "docs" / "claims.yaml"
    if not path.is_file():
        raise UserError(f"--claims {path}: no such file")
    try:
        claims = load_claims(path)
    except ClaimError as e:
        raise UserError(str(e)) from None
    failed = check_claims(args.repo, claims)
    for claim, why in failed:
        print(f"{path.name} entry {claim.index}: {why}")
    print(f"python -m tools.docs claims: {len(claims)} claims, {len(failed) or 'none'} failing", file=sys.stderr)
    return 1 if failed else 0


def _configure_reference(p: argparse.ArgumentParser) -> None:
    _repo(p)
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming each page that differs from the code (or is missing or extra)")


@commands.add("reference", "write docs/reference/ from the code (flags, config keys, routes, schemas)",
              _configure_reference)
def _reference(args) -> int:
    from tools.docs.reference import REFERENCE, generate, stale_pages, write_pages

    pages = generate()
    if args.check:
        stale = stale_pages(args.repo, pages)
        for line in stale:
            print(line)
        if stale:
            print(f"python -m tools.docs reference: {REFERENCE}/ is out of date: run `python -m tools.docs reference`",
                  file=sys.stderr)
        return 1 if stale else 0
    written = write_pages(args.repo, pages)
    print(f"python -m tools.docs reference: {len(pages)} pages in {REFERENCE}/ ({written} changed)")
    return 0


def _configure_run_guides(p: argparse.ArgumentParser) -> None:
    _repo(p)
    p.add_argument("--page", action="append", metavar="PAGE",
                   help="a guide to run (a path, or a name under docs/guides/: serve or serve.md); repeatable; "
                        "default: every page")
    p.add_argument("--shared", type=Path, metavar="DIR",
                   help="what ../shared is from the copy (default: REPO/../shared)")
    p.add_argument("--keep", action="store_true", help="keep each page's copy of the repository (printed)")


def _guide_page(repo: Path, name: str) -> Path:
    from tools.docs.guides import GUIDES

    path = Path(name)
    for candidate in (path, repo / path, repo / GUIDES / path, repo / GUIDES / f"{name}.md"):
        if candidate.is_file():
            return candidate.resolve()
    raise UserError(f"--page {name}: no such guide (looked in {GUIDES}/)")


@commands.add("run-guides", "run the guides' <!-- ci: run --> bash blocks, each page in a fresh copy of the repository",
              _configure_run_guides)
def _run_guides(args) -> int:
    from tools.docs.guides import guide_pages, run_page

    repo = args.repo.resolve()
    pages = [_guide_page(repo, name) for name in args.page] if args.page else guide_pages(repo)
    shared = args.shared if args.shared is not None else repo.parent / "shared"
    if args.shared is not None and not shared.is_dir():
        raise UserError(f"--shared {shared}: no such directory")
    failed = 0
    for page in pages:
        results = run_page(repo, page, shared=shared, keep=args.keep, report=lambda line: print(line, flush=True))
        failed += any(not r.ok for r in results)
    print(f"python -m tools.docs run-guides: {len(pages)} page(s), {failed} failing", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(commands.main(sys.argv[1:]))
