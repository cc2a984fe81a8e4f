"""Tokenizers: round trips, EOD handling, the embedded assets, GPT-2 files, and bad input.

All comparisons are exact (ids and strings): tokenization is deterministic.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from megatron.components.tokenizer import (
    DEFAULT_CORPUS,
    DEFAULT_TOKENIZER_MODEL,
    EOD_TOKEN,
    NullTokenizer,
    build_tokenizer,
)
from tools.data import train_tokenizer

from .conftest import REPO, SHARED_DATA, requires_shared_data

MIXED_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  naïve café — 東京 🙂\t<unk> @-@ 3.5"


def test_embedded_tokenizer_round_trip_and_interface(tiny_tokenizer):
    from megatron.core.tokenizers import MegatronTokenizerBase

    tok = tiny_tokenizer
    assert isinstance(tok, MegatronTokenizerBase)
    assert tok.vocab_size == 2048
    assert tok.eod == tok.vocab[EOD_TOKEN] == 0
    assert tok.pad == -1  # no pad token: megatron-core's "none" id, distinct from EOD
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        corpus = f.read(20000)
    for text in (corpus, MIXED_TEXT, ""):
        ids = tok.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # the EOD string in text is one token, and survives detokenization
    ids = tok.tokenize("end." + EOD_TOKEN + "Start")
    assert ids.count(tok.eod) == 1 and tok.detokenize(ids) == "end." + EOD_TOKEN + "Start"
    assert tok.tokenize_batch(["a b", MIXED_TEXT]) == [tok.tokenize("a b"), tok.tokenize(MIXED_TEXT)]
    assert tok.inv_vocab[tok.eod] == EOD_TOKEN
    json.dumps(tok.unique_identifiers)  # part of GPTDataset's cache key: must serialize


def test_embedded_tokenizer_is_what_train_tokenizer_makes():
    """The committed tiny_bpe.json equals a fresh training run on the committed corpus."""
    from tokenizers import Tokenizer

    fresh = train_tokenizer.train_bpe([DEFAULT_CORPUS], 2048)
    assert fresh.to_str() == Tokenizer.from_file(DEFAULT_TOKENIZER_MODEL).to_str()


def test_embedded_corpus_matches_attribution():
    """The README's sha256 is the shipped corpus's, so the attribution names this exact file."""
    readme = (REPO / "megatron/components/assets/README.md").read_text()
    with open(DEFAULT_CORPUS, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest in readme
    assert re.search(r"public domain", readme, re.IGNORECASE)


def test_train_tokenizer_deterministic_and_safe(tmp_path):
    src = tmp_path / "corpus.txt"
    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        src.write_text(f.read(60000))
    outs = [tmp_path / "one.json", tmp_path / "two.json"]
    for out in outs:
        assert train_tokenizer.main(["--input", str(src), "--vocab-size", "400", "--output", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    tok = build_tokenizer("HuggingFaceTokenizer", str(outs[0]))
    assert tok.vocab_size == 400 and tok.eod == 0
    assert tok.detokenize(tok.tokenize(MIXED_TEXT)) == MIXED_TEXT  # byte-level: nothing unknown
    before = outs[0].read_bytes()
    assert train_tokenizer.main(["--input", str(src), "--vocab-size", "300", "--output", str(outs[0])]) == 2
    assert outs[0].read_bytes() == before
    assert train_tokenizer.main(["--input", str(tmp_path / "nope.txt"), "--vocab-size", "300",
                                        "--output", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "one.json", "two.json"]  # no temp files


@requires_shared_data
def test_gpt2_files_and_tokenizer_json_agree():
    """encoder.json + vocab.bpe (GPT2BPETokenizer) and tokenizer.json (HuggingFaceTokenizer)
    are the same GPT-2 BPE: identical ids on real text, the README's reference ids, round trips."""
    gpt2 = SHARED_DATA / "tokenizers" / "gpt2"
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2 / "encoder.json"), merge_file=str(gpt2 / "vocab.bpe"))
    hf = build_tokenizer("HuggingFaceTokenizer", str(gpt2 / "tokenizer.json"))
    hf_dir = build_tokenizer("HuggingFaceTokenizer", str(gpt2))
    assert bpe.vocab_size == hf.vocab_size == 50257
    assert bpe.eod == hf.eod == hf_dir.eod == 50256
    assert bpe.tokenize("Hello world, MoE routing!") == [15496, 995, 11, 4270, 36, 28166, 0]
    stories = (SHARED_DATA / "pretrain/tinystories/tinystories_sample.txt").read_text(encoding="utf-8")
    wiki = (SHARED_DATA / "pretrain/wikitext-2/valid.txt").read_text(encoding="utf-8")[:100000]
    for text in (stories, wiki, MIXED_TEXT):
        ids = bpe.tokenize(text)
        assert ids == hf.tokenize(text) == hf_dir.tokenize(text)
        assert bpe.detokenize(ids) == text and hf.detokenize(ids) == text
    assert bpe.tokenize(stories).count(50256) == stories.count(EOD_TOKEN) == 5


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100  # Megatron-LM: EOD is the id after the vocab
    assert tok.tokenize("3 7 1 100") == [3, 7, 1, 100]
    assert tok.detokenize([3, 7, 1]) == "3 7 1"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("3 101")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("three")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_bad_tokenizer_arguments(tmp_path):
    cases = [
        (dict(tokenizer_type="SentencePieceTokenizer"), "unknown tokenizer type 'SentencePieceTokenizer'"),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing.json")),
         "no such file or directory"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)), "no tokenizer.json in directory"),
        (dict(tokenizer_type="GPT2BPETokenizer", merge_file=DEFAULT_TOKENIZER_MODEL), "needs --vocab-file"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"),
              merge_file=str(tmp_path / "m.txt")), "--vocab-file: no such file"),
    ]
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    cases.append((dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(garbage)), "cannot read"))
    # a valid tokenizer.json without any end-of-document token
    from tokenizers import Tokenizer, models

    no_eod = tmp_path / "no_eod.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(no_eod))
    cases.append((dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(no_eod)), "no end-of-document token"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            build_tokenizer(**kwargs)
        assert "\n" not in str(info.value)


def test_tokenizer_config_eos_is_used(tmp_path):
    """A tokenizer.json directory with tokenizer_config.json: its eos_token is the EOD."""
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, "</s>": 1, "a": 2, "[UNK]": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 1
