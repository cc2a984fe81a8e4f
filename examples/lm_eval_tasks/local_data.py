"""Offline datasets for the ``local_*`` lm-eval tasks: local files -> the hub datasets' fields.

Each YAML here names one loader as its ``custom_dataset``; lm-eval calls it with the task's
metadata, into which ``evaluate_lm --data-dir DIR`` (or ``lm_eval --metadata '{"data_dir": DIR}'``)
puts ``data_dir``. ``DIR`` has the layout of the project's shared data directory
(``eval/arc/arc_easy.jsonl``, ``pretrain/wikitext-2-raw/wiki.test.raw``, ...). Nothing is
downloaded and no Hugging Face cache is written: records are read with ``json`` and wrapped in
``datasets.Dataset``.

The loaders rename the files' fields to those of the hub datasets the standard lm-eval tasks read
(``question``/``choices``, ``goal``/``sol1``/``sol2``/``label``, ``passage``/``question``/``label``,
``page``, ...), so each YAML keeps the prompt of its hub counterpart (``arc_easy``, ``piqa``,
``boolq``, ``openbookqa``, ``winogrande``, ``lambada_openai``, ``wikitext``) and the scores are
comparable to published lm-eval figures. Where the local copy is the llm-foundry re-formatting of
the same split, the prompt is rebuilt from its fields (see each loader).
"""

from __future__ import annotations

import json
import os
import re

DATA_DIR_HELP = ("pass --data-dir DIR to evaluate_lm, or --metadata '{\"data_dir\": \"DIR\"}' to lm_eval "
                 "(DIR: the shared data directory holding eval/ and pretrain/)")


def _path(data_dir, *parts) -> str:
    if not data_dir:
        raise ValueError(f"the local_* lm-eval tasks need a data directory: {DATA_DIR_HELP}")
    path = os.path.join(data_dir, *parts)
    if not os.path.isfile(path):
        raise ValueError(f"local lm-eval task data: no such file {path} (data_dir={data_dir})")
    return path


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(split: str, records: list[dict]):
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(records)})


def _strip_prefix(text: str, prefix: str) -> str:
    return text[len(prefix):] if text.startswith(prefix) else text


# --- multiple choice (llm-foundry {"query", "choices", "gold"} files) -------------------------


def _arc(data_dir, name):
    rows = _jsonl(_path(data_dir, "eval", "arc", f"{name}.jsonl"))
    # llm-foundry's query is "Question: <question>"; the hub task's prompt adds "\nAnswer:"
    return _dataset("test", [{"question": _strip_prefix(r["query"], "Question: "), "choices": r["choices"],
                              "gold": int(r["gold"])} for r in rows])


def arc_easy(data_dir=None, **_):
    """ARC-Easy test (2,376): ``eval/arc/arc_easy.jsonl``."""
    return _arc(data_dir, "arc_easy")


def arc_challenge(data_dir=None, **_):
    """ARC-Challenge test (1,172): ``eval/arc/arc_challenge.jsonl``."""
    return _arc(data_dir, "arc_challenge")


def openbookqa(data_dir=None, **_):
    """OpenBookQA test (500): ``eval/openbookqa/openbook_qa.jsonl`` (query = the question stem)."""
    rows = _jsonl(_path(data_dir, "eval", "openbookqa", "openbook_qa.jsonl"))
    return _dataset("test", [{"question_stem": r["query"], "choices": r["choices"], "gold": int(r["gold"])}
                             for r in rows])


def boolq(data_dir=None, **_):
    """BoolQ dev (3,270): ``eval/boolq/boolq.jsonl``, query "Passage: P\\nQuestion: Q?" split back
    into the hub's ``passage`` and ``question`` (without its "?", which the prompt adds)."""
    rows = _jsonl(_path(data_dir, "eval", "boolq", "boolq.jsonl"))
    out = []
    for r in rows:
        passage, sep, question = _strip_prefix(r["query"], "Passage: ").rpartition("\nQuestion: ")
        if not sep:
            raise ValueError(f"boolq.jsonl: a query without '\\nQuestion: ': {r['query'][:60]!r}")
        if question.endswith("?"):
            question = question[:-1]
        out.append({"passage": passage, "question": question, "label": int(r["gold"])})
    return _dataset("validation", out)


def piqa(data_dir=None, **_):
    """PIQA dev (1,838) in its original release: ``eval/piqa/valid.jsonl`` + ``valid-labels.lst``."""
    rows = _jsonl(_path(data_dir, "eval", "piqa", "valid.jsonl"))
    with open(_path(data_dir, "eval", "piqa", "valid-labels.lst"), encoding="utf-8") as f:
        labels = [int(line) for line in f if line.strip()]
    if len(labels) != len(rows):
        raise ValueError(f"piqa: {len(rows)} questions but {len(labels)} labels")
    return _dataset("validation", [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": y}
                                   for r, y in zip(rows, labels)])


def winogrande(data_dir=None, **_):
    """WinoGrande dev (1,267): ``eval/winogrande/winogrande.jsonl`` ({"context_options", "continuation",
    "gold"}: the sentence up to each option, and the rest), lm-eval's partial scoring of the hub task."""
    rows = _jsonl(_path(data_dir, "eval", "winogrande", "winogrande.jsonl"))
    return _dataset("validation", [{"contexts": r["context_options"], "continuation": r["continuation"],
                                    "gold": int(r["gold"])} for r in rows])


def winogrande_doc_to_text(doc) -> int:
    # multiple-input task: the "text" is the gold context's index (lm-eval's winogrande)
    return doc["gold"]


def winogrande_doc_to_target(doc) -> str:
    return doc["continuation"]


def winogrande_doc_to_choice(doc) -> list:
    return doc["contexts"]


# --- language modelling -------------------------------------------------------------------------


def lambada(data_dir=None, **_):
    """LAMBADA test, OpenAI's version (5,153; the file behind ``lambada_openai``)."""
    return _dataset("test", _jsonl(_path(data_dir, "eval", "lambada", "lambada_test.jsonl")))


_ARTICLE_HEADING = re.compile(r"^ = [^=].* = $")


def wikitext_pages(lines: list[str]) -> list[str]:
    """Split WikiText lines into articles at their top-level headings (`` = Title = ``), joined with
    newlines; a document-level split like the hub's ``wikitext_document_level``."""
    pages, current = [], []
    for line in lines:
        if _ARTICLE_HEADING.match(line.rstrip("\n")) and current:
            pages.append("".join(current))
            current = []
        current.append(line if line.endswith("\n") else line + "\n")
    if current:
        pages.append("".join(current))
    return pages


def wikitext(data_dir=None, **_):
    """WikiText-2 raw test articles: ``pretrain/wikitext-2-raw/wiki.test.raw`` (the shared copy has its
    empty lines dropped, so page texts differ from the hub's by blank lines only)."""
    with open(_path(data_dir, "pretrain", "wikitext-2-raw", "wiki.test.raw"), encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    return _dataset("test", [{"page": page} for page in wikitext_pages(lines)])


def wikitext_detokenizer(doc):
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as detok

    return detok(doc)


def wikitext_process_results(doc, results):
    from lm_eval.tasks.wikitext.preprocess_wikitext import process_results

    return process_results(doc, results)
