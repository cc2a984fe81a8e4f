"""Tokenize text into megatron-core indexed datasets (``.bin`` + ``.idx``), as Megatron-LM's
``tools/preprocess_data.py`` (``python -m tools.data.preprocess_data``, or ``scripts/preprocess_data.py``).

    python -m tools.data.preprocess_data --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe --append-eod --workers 2

writes ``data/corpus_text_document.bin/.idx``; train with ``--data-path data/corpus_text_document``.
One output per JSON key: ``{output_prefix}_{key}_document``, Megatron-LM's naming.

Inputs (one or more files, read in the order given; all of one kind):

* plain text (any extension but ``.json``/``.jsonl``): by default each blank-line separated
  block is a document (``--document-boundary blank-line``); ``--document-boundary file`` makes
  each file one document. Documents are named by the key ``text``.
* JSON lines (``.jsonl``/``.json``): one object per line; each ``--json-keys`` field is a document.
* anything HF ``datasets`` reads locally (``--hf-dataset-format parquet|json|csv|arrow|text``):
  records are streamed from the local files, nothing is downloaded.

``--append-eod`` ends every document with the tokenizer's EOD token (what GPT pretraining
wants: ``GPTDataset`` concatenates documents). Outputs are written under temporary names and
renamed into place when complete; existing outputs are left untouched unless ``--overwrite``.
Bad input exits with status 2 and a one-line ``error:`` message.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Iterator

from megatron.common.cli import UserError, run_cli, user_input

PROG = "preprocess_data.py"
HF_FORMATS = ("parquet", "json", "csv", "arrow", "text")
_CHUNK = 256  # documents per tokenization task


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize text/jsonl/HF-dataset files into megatron-core .bin/.idx files.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="input files (text, jsonl, or --hf-dataset-format)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="fields to extract from json/HF records")
    g.add_argument("--document-boundary", default="blank-line", choices=["blank-line", "file"],
                   help="plain text: a document per blank-line separated block, or per file")
    g.add_argument("--hf-dataset-format", choices=HF_FORMATS, default=None,
                   help="read --input with HF datasets' local loader of this format")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True,
                   help="HuggingFaceTokenizer, GPT2BPETokenizer or NullTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer.json (or its directory)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 encoder.json / vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 vocab.bpe / merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return p.parse_args(argv)


def _tokenizer_kwargs(args) -> dict:
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )


def _input_kind(args) -> str:
    if args.hf_dataset_format:
        return "hf"
    kinds = {"jsonl" if f.lower().endswith((".jsonl", ".json")) else "text" for f in args.input}
    if len(kinds) > 1:
        raise UserError("--input mixes JSON lines and plain text files; preprocess them separately")
    return kinds.pop()


def iter_records(args, kind: str) -> Iterator[tuple[str, ...]]:
    """One tuple of document texts (one per key) per record, in input order."""
    if kind == "text":
        from megatron.training.preprocess import read_text_documents

        for path in args.input:
            for doc in read_text_documents(path, args.document_boundary):
                yield (doc,)
    elif kind == "jsonl":
        for path in args.input:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as err:
                        raise UserError(f"{path}:{lineno}: not valid JSON ({err})") from None
                    yield _fields(record, args.json_keys, f"{path}:{lineno}")
    else:
        yield from _iter_hf_records(args)


def _fields(record, keys, where: str) -> tuple[str, ...]:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    out = []
    for key in keys:
        if key not in record:
            raise UserError(f"{where}: no key {key!r} (--json-keys; it has {', '.join(map(repr, record))})")
        if not isinstance(record[key], str):
            raise UserError(f"{where}: key {key!r} is {type(record[key]).__name__}, not text")
        out.append(record[key])
    return tuple(out)


def _iter_hf_records(args) -> Iterator[tuple[str, ...]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
    try:
        import datasets
    except ImportError:
        raise UserError("--hf-dataset-format needs HF datasets: pip install datasets") from None
    try:
        # streaming reads the files in place; its lock files go to a throwaway cache directory
        with tempfile.TemporaryDirectory(prefix="hf-datasets-") as cache_dir:
            ds = datasets.load_dataset(
                args.hf_dataset_format, data_files=list(args.input), split="train",
                streaming=True, cache_dir=cache_dir,
            )
            for i, record in enumerate(ds):
                yield _fields(record, args.json_keys, f"record {i} of {args.input[0]}")
    except UserError:
        raise
    except Exception as err:  # datasets/pyarrow errors are long; keep the first line
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--input: cannot read {' '.join(args.input)} as {args.hf_dataset_format} ({msg})") from None


# --- tokenization (in-process or in worker processes) ----------------------------------------
_WORKER = {}


def _init_worker(tokenizer_kwargs: dict, append_eod: bool) -> None:
    from megatron.components.tokenizer import build_tokenizer

    _WORKER["tokenizer"] = build_tokenizer(**tokenizer_kwargs)
    _WORKER["append_eod"] = append_eod


def _encode_chunk(chunk: list[tuple[str, ...]]) -> list[list[list[int]]]:
    """[record][key] -> ids."""
    tok = _WORKER["tokenizer"]
    eod = [tok.eod] if _WORKER["append_eod"] else []
    per_key = [tok.tokenize_batch([rec[k] for rec in chunk]) for k in range(len(chunk[0]))]
    # as Megatron-LM: an empty document stays empty (and is skipped), it gets no lone EOD
    return [[ids + eod if ids else ids for ids in (per_key[k][r] for k in range(len(per_key)))]
            for r in range(len(chunk))]


def _chunks(it, n):
    it = iter(it)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def preprocess(args) -> list:
    """Run the whole job; returns the ``IndexedDatasetStats`` per key."""
    from megatron.training.preprocess import check_outputs_free, write_indexed_dataset
    from megatron.components.tokenizer import build_tokenizer

    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    for path in args.input:
        if not os.path.isfile(path):
            raise UserError(f"--input: no such file: {path}")
    kind = _input_kind(args)
    keys = ["text"] if kind == "text" else list(args.json_keys)
    if kind == "text" and args.json_keys != ["text"]:
        raise UserError("--json-keys applies to JSON lines and HF datasets, not plain text input")
    if len(set(keys)) != len(keys):
        raise UserError(f"--json-keys repeats a key: {' '.join(keys)}")
    prefixes = [f"{args.output_prefix}_{key}_document" for key in keys]
    check_outputs_free(prefixes, args.overwrite)
    with user_input():
        tokenizer = build_tokenizer(**_tokenizer_kwargs(args))  # fail fast on a bad tokenizer

    records = iter_records(args, kind)
    chunks = _chunks(records, _CHUNK)
    if args.workers == 1:
        _init_worker(_tokenizer_kwargs(args), args.append_eod)
        encoded = map(_encode_chunk, chunks)
        pool = None
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes instead
        pool = multiprocessing.get_context("fork").Pool(
            args.workers, initializer=_init_worker, initargs=(_tokenizer_kwargs(args), args.append_eod)
        )
        encoded = pool.imap(_encode_chunk, chunks)  # ordered: output independent of --workers
    try:
        if len(keys) == 1:
            docs = (rec[0] for chunk in encoded for rec in chunk)
            return [write_indexed_dataset(docs, prefixes[0], tokenizer.vocab_size, args.overwrite)]
        # several keys: keep every key's documents (memory ~ the token count), then write each
        per_key = [[] for _ in keys]
        for chunk in encoded:
            for rec in chunk:
                for k, ids in enumerate(rec):
                    per_key[k].append(ids)
        if not per_key[0]:
            raise UserError(f"no documents in {' '.join(args.input)}")
        return [
            write_indexed_dataset(docs, prefix, tokenizer.vocab_size, args.overwrite)
            for docs, prefix in zip(per_key, prefixes)
        ]
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()

    def body():
        for s in preprocess(args):
            print(f"wrote {s.prefix}.bin/.idx: {s.num_documents} documents, {s.num_tokens} tokens ({s.dtype})")
        print(f"done in {time.time() - t0:.1f}s")

    # an input that cannot be read or an output that cannot be written is one line too
    return run_cli(PROG, body, user_errors=(UserError, OSError))


if __name__ == "__main__":
    sys.exit(main())
