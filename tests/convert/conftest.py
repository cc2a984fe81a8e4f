"""Tiny HF models per family, converted to our checkpoints and exported back once per session."""

from __future__ import annotations

import dataclasses
import os

import pytest

pytest.importorskip("transformers")


@dataclasses.dataclass(frozen=True)
class Converted:
    family: str
    hf_dir: str
    ckpt: str
    exported: str
    ref_logits: object  # [B, S, V] HF logits of the prompt
    ref_tokens: object  # [B, 16] HF greedy continuation


def _convert(root, family: str, yarn: bool = False) -> Converted:
    from tools.spawn import run_distributed
    from tests.convert import hf_models as H

    extra = H.DEEPSEEK_LITE_YARN if yarn else {}
    hf_dir = H.make_hf_model(str(root / "hf"), family, **extra)
    ckpt, exported = str(root / "ckpt"), str(root / "exported")
    codes = run_distributed(H.cli_rank, 1, [
        ["--from", "hf", "--hf-dir", hf_dir, "--to", "mcore", "--out", ckpt],
        ["--from", "mcore", "--load", ckpt, "--to", "hf", "--out", exported],
    ], timeout_s=240)[0]
    assert [c for c, _ in codes] == [0, 0], codes
    logits, tokens = H.hf_reference(hf_dir, family, yarn_softmax_fix=yarn)
    return Converted(family, hf_dir, ckpt, exported, logits, tokens)


_CACHE: dict = {}


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(family, yarn=False) -> Converted, built on first use."""

    def get(family: str, yarn: bool = False) -> Converted:
        key = (family, yarn)
        if key not in _CACHE:
            _CACHE[key] = _convert(tmp_path_factory.mktemp(f"{family}{'_yarn' if yarn else ''}"), family, yarn)
        return _CACHE[key]

    return get


def no_temporaries(directory) -> bool:
    return not any(name.startswith(".tmp-") for name in os.listdir(directory))
