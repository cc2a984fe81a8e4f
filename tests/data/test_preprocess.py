"""tools/data/preprocess_data.py (scripts/preprocess_data.py): text/jsonl/HF inputs -> .bin/.idx,
read back exactly, and bad input.

Every check is exact: the tokens read back from the IndexedDataset must equal direct
tokenization of each document (plus EOD when asked), document by document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL
from tools.data import preprocess_data

from .conftest import REPO, SHARED_DATA, requires_shared_data

DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "All:\nSpeak, speak.",
    "  = Indented heading =\n\tnaïve café — 東京 🙂",
    "Last one, no trailing newline",
]
TOK_ARGS = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", DEFAULT_TOKENIZER_MODEL]


def read_documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert list(ds.document_indices) == list(range(len(ds) + 1))  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def write_text(path, blocks, separator="\n\n\n  \n"):
    """Blocks separated by blank and whitespace-only lines, with leading/trailing blank lines."""
    path.write_text("\n" + separator.join(blocks) + "\n\n", encoding="utf-8")
    return str(path)


def test_text_round_trip_with_eod(tmp_path, tiny_tokenizer):
    src = write_text(tmp_path / "in.txt", DOCS)
    out = str(tmp_path / "out")
    assert preprocess_data.main(["--input", src, "--output-prefix", out, "--append-eod"] + TOK_ARGS) == 0
    docs = read_documents(out + "_text_document")
    assert docs == [tiny_tokenizer.tokenize(d) + [tiny_tokenizer.eod] for d in DOCS]
    # EOD exactly once per document, at its end (the corpus has no EOD string of its own)
    assert all(d.count(tiny_tokenizer.eod) == 1 and d[-1] == tiny_tokenizer.eod for d in docs)
    assert [tiny_tokenizer.detokenize(d[:-1]) for d in docs] == DOCS
    with open(out + "_text_document.idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"  # megatron-core's index magic
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out_text_document.bin", "out_text_document.idx"]


def test_text_per_file_documents_without_eod(tmp_path, tiny_tokenizer):
    texts = ["One file.\n\nStill the same document.\n", "Second file, one line."]
    files = []
    for i, t in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_text(t, encoding="utf-8")
        files.append(str(tmp_path / f"f{i}.txt"))
    out = str(tmp_path / "out")
    args = ["--input", *files, "--output-prefix", out, "--document-boundary", "file"] + TOK_ARGS
    assert preprocess_data.main(args) == 0
    assert read_documents(out + "_text_document") == [tiny_tokenizer.tokenize(t) for t in texts]


def test_jsonl_keys_workers_and_null_tokenizer(tmp_path, tiny_tokenizer):
    """Two keys -> two datasets; --workers 2 writes byte-identical files to --workers 1; a
    record with an empty field is skipped for that key (no lone EOD), as in Megatron-LM."""
    records = [{"text": d, "title": f"doc {i}", "id": i} for i, d in enumerate(DOCS * 150)]
    records[3]["title"] = ""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n", encoding="utf-8")
    outs = {}
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        args = ["--input", str(src), "--json-keys", "text", "title", "--output-prefix", out,
                "--append-eod", "--workers", str(workers)] + TOK_ARGS
        assert preprocess_data.main(args) == 0
        outs[workers] = out
    eod = [tiny_tokenizer.eod]
    assert read_documents(outs[1] + "_text_document") == [tiny_tokenizer.tokenize(r["text"]) + eod for r in records]
    assert read_documents(outs[1] + "_title_document") == [
        tiny_tokenizer.tokenize(r["title"]) + eod for r in records if r["title"]
    ]
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            with open(f"{outs[1]}_{key}_document{ext}", "rb") as a, open(f"{outs[2]}_{key}_document{ext}", "rb") as b:
                assert a.read() == b.read()

    null_src = tmp_path / "ids.jsonl"
    null_src.write_text('{"text": "5 6 7"}\n{"text": "9"}\n')
    out = str(tmp_path / "null")
    args = ["--input", str(null_src), "--output-prefix", out, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10", "--append-eod"]
    assert preprocess_data.main(args) == 0
    assert read_documents(out + "_text_document") == [[5, 6, 7, 10], [9, 10]]


def test_hf_datasets_parquet(tmp_path, tiny_tokenizer):
    pytest.importorskip("datasets", reason="HF datasets is optional (pip install datasets)")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), str(path))
    out = str(tmp_path / "out")
    args = ["--input", str(path), "--hf-dataset-format", "parquet", "--json-keys", "content",
            "--output-prefix", out, "--append-eod"] + TOK_ARGS
    assert preprocess_data.main(args) == 0
    assert read_documents(out + "_content_document") == [tiny_tokenizer.tokenize(d) + [tiny_tokenizer.eod] for d in DOCS]
    bad = ["--input", str(path), "--hf-dataset-format", "parquet", "--json-keys", "text",
           "--output-prefix", str(tmp_path / "bad")] + TOK_ARGS
    assert preprocess_data.main(bad) == 2
    assert not any(p.name.startswith(("bad", ".bad")) for p in tmp_path.iterdir())


@requires_shared_data
def test_gpt2_preprocess_on_shared_data(tmp_path):
    """TinyStories sample with GPT-2 files: its own <|endoftext|> markers are EOD tokens, and
    the 50257-id vocabulary fits uint16."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.components.tokenizer import build_tokenizer

    gpt2 = SHARED_DATA / "tokenizers" / "gpt2"
    src = SHARED_DATA / "pretrain/tinystories/tinystories_sample.txt"
    out = str(tmp_path / "stories")
    args = ["--input", str(src), "--output-prefix", out, "--document-boundary", "file",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2 / "encoder.json"),
            "--merge-file", str(gpt2 / "vocab.bpe")]
    assert preprocess_data.main(args) == 0
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2 / "encoder.json"), merge_file=str(gpt2 / "vocab.bpe"))
    (doc,) = read_documents(out + "_text_document")
    assert doc == tok.tokenize(src.read_text(encoding="utf-8")) and doc.count(tok.eod) == 5
    assert IndexedDataset(out + "_text_document").index.dtype == np.uint16


def test_bad_input_errors_and_existing_outputs_untouched(tmp_path, capsys):
    src = write_text(tmp_path / "in.txt", DOCS)
    out = str(tmp_path / "out")
    assert preprocess_data.main(["--input", src, "--output-prefix", out] + TOK_ARGS) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = write_text(tmp_path / "other.txt", ["completely different text"])
    before["other.txt"] = (tmp_path / "other.txt").read_bytes()
    capsys.readouterr()

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": oops}\n')
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"body": "x"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    before.update({p.name: p.read_bytes() for p in (bad_json, no_key, empty)})
    cases = [
        (["--input", other, "--output-prefix", out] + TOK_ARGS, "exists (pass --overwrite"),
        (["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "m")] + TOK_ARGS,
         "--input: no such file"),
        (["--input", other, "--output-prefix", str(tmp_path / "u"), "--tokenizer-type", "BertWordPiece"],
         "unknown tokenizer type 'BertWordPiece'"),
        (["--input", str(bad_json), "--output-prefix", str(tmp_path / "j")] + TOK_ARGS, "bad.jsonl:2: not valid JSON"),
        (["--input", str(no_key), "--output-prefix", str(tmp_path / "k")] + TOK_ARGS, "no key 'text'"),
        (["--input", str(empty), "--output-prefix", str(tmp_path / "e")] + TOK_ARGS, "no documents"),
        (["--input", other, str(no_key), "--output-prefix", str(tmp_path / "x")] + TOK_ARGS, "mixes"),
    ]
    for args, message in cases:
        assert preprocess_data.main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    # nothing was written or changed: the old outputs are byte-identical, no temp files remain
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    # --overwrite replaces them (renamed into place, not edited)
    assert preprocess_data.main(["--input", other, "--output-prefix", out, "--overwrite"] + TOK_ARGS) == 0
    assert (tmp_path / "out_text_document.bin").read_bytes() != before["out_text_document.bin"]
    assert len(read_documents(out + "_text_document")) == 1


def test_cli_error_is_one_line(tmp_path):
    """As a command: exit status 2 and a single stderr line (upstream import notices silenced)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", str(tmp_path / "nope.txt"),
         "--output-prefix", str(tmp_path / "o")] + TOK_ARGS,
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"preprocess_data.py: error: --input: no such file: {tmp_path / 'nope.txt'}"]


def test_prepare_corpus_script_checks_its_input(tmp_path):
    """The corpus recipe stops with one line naming the missing file (the full run, about 50 s,
    is documented in docs/guides/data.md rather than run here)."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/prepare_pretrain_corpus.sh"), str(tmp_path / "no_shared"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"prepare_pretrain_corpus.sh: error: missing {tmp_path / 'no_shared'}/pretrain/war_and_peace/warpeace_input.txt "
        f"(is {tmp_path / 'no_shared'} the shared data directory?)"
    ]
    assert not (tmp_path / "out").exists()
