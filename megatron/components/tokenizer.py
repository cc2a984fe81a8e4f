"""Tokenizers by Megatron-LM type name, built from local files only (nothing is downloaded).

``build_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)`` mirrors Megatron-LM's
``--tokenizer-type`` / ``--tokenizer-model`` / ``--vocab-file`` / ``--merge-file`` flags:

* ``HuggingFaceTokenizer``: a HF ``tokenizer.json`` (or a directory holding one), loaded with the
  ``tokenizers`` library. Never resolved against the HF hub.
* ``GPT2BPETokenizer``: OpenAI GPT-2 files, ``encoder.json``/``vocab.json`` (``--vocab-file``) and
  ``vocab.bpe``/``merges.txt`` (``--merge-file``), as a byte-level BPE with ``<|endoftext|>`` as EOD.
* ``NullTokenizer``: ids written as space-separated integers (benchmarks and debugging); its EOD is
  the id ``vocab_size`` passed in, so ``.vocab_size`` is one larger, as in Megatron-LM.

The objects subclass megatron-core's ``MegatronTokenizerBase`` and provide what ``GPTDataset``
reads from ``config.tokenizer``: ``vocab_size`` (a property), ``eod``, ``pad`` and
``unique_identifiers`` (part of the dataset cache key), plus ``tokenize(str) -> list[int]`` and
``detokenize(list[int]) -> str``. ``tokenize`` never adds BOS/EOS: documents get their EOD from
``scripts/preprocess_data.py --append-eod``. ``detokenize(tokenize(text)) == text`` for the
byte-level tokenizers (special tokens are kept, not skipped).

``DEFAULT_TOKENIZER_MODEL`` is the embedded byte-level BPE (2048 ids, trained on tiny-shakespeare
by ``scripts/train_tokenizer.py``); ``DEFAULT_CORPUS`` is that corpus. ``resolve_tokenizer`` is the
tokenizer a run's data flags name (the embedded one without them), ``tokenizer_files_of`` the
files every checkpoint of the run copies.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron.common.cli import UserError

if TYPE_CHECKING:
    from megatron.components.arguments import Configs

__all__ = [
    "TOKENIZER_TYPES",
    "DEFAULT_TOKENIZER_MODEL",
    "DEFAULT_CORPUS",
    "EOD_TOKEN",
    "build_tokenizer",
    "resolve_tokenizer",
    "tokenizer_files_of",
    "HFTokenizer",
    "NullTokenizer",
]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_MODEL = str(ASSETS_DIR / "tiny_bpe.json")
DEFAULT_CORPUS = str(ASSETS_DIR / "tinyshakespeare.txt")

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")

EOD_TOKEN = "<|endoftext|>"
# Looked up in this order when a tokenizer.json does not say which token ends a document.
_EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<EOS>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<PAD>")
# megatron-core's "no pad token" id (megatron/core/datasets/megatron_dataset.py: _PAD_TOKEN_ID).
NO_PAD_ID = -1


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    *,
    vocab_size: Optional[int] = None,
) -> MegatronTokenizerBase:
    """Build a tokenizer from local files. ``vocab_size`` is only for ``NullTokenizer``.

    Raises ``ValueError`` (one line, naming the flag or file) for an unknown type, a missing
    argument or a missing/unreadable file.
    """
    if tokenizer_type == "HuggingFaceTokenizer":
        path = _tokenizer_json_path(tokenizer_model)
        return HFTokenizer.from_file(path, tokenizer_type=tokenizer_type)
    if tokenizer_type == "GPT2BPETokenizer":
        return HFTokenizer.from_gpt2_files(
            _existing_file(vocab_file, "--vocab-file", tokenizer_type),
            _existing_file(merge_file, "--merge-file", tokenizer_type),
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError("NullTokenizer needs a positive vocab size (--vocab-size)")
        return NullTokenizer(int(vocab_size))
    raise ValueError(
        f"--tokenizer-type: unknown tokenizer type {tokenizer_type!r} "
        f"(choose from {', '.join(TOKENIZER_TYPES)})"
    )


def resolve_tokenizer(c: Configs):
    """The tokenizer named by the data flags, or the embedded BPE when none is given."""
    d = c.data
    if d.tokenizer_type is None:
        if d.data_path is not None:
            raise UserError("--data-path needs --tokenizer-type (and its model/vocab files)")
        return build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    if d.data_path is None:
        raise UserError(
            f"--tokenizer-type {d.tokenizer_type} needs --data-path: the embedded corpus is "
            "tokenized with the embedded tokenizer"
        )
    return build_tokenizer(
        d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, vocab_size=c.model.vocab_size
    )


def tokenizer_files_of(c: Configs) -> dict:
    """The files that define the tokenizer ({flag role: path}), copied into every checkpoint."""
    d = c.data
    if d.tokenizer_type is None:
        return {"tokenizer_model": DEFAULT_TOKENIZER_MODEL}
    if d.tokenizer_type == "HuggingFaceTokenizer":
        path = d.tokenizer_model
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return {"tokenizer_model": path}
    if d.tokenizer_type == "GPT2BPETokenizer":
        return {"vocab_file": d.vocab_file, "merge_file": d.merge_file}
    return {}


def _existing_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file: {path}")
    return str(path)


def _tokenizer_json_path(tokenizer_model: Optional[str]) -> str:
    if not tokenizer_model:
        raise ValueError(
            "HuggingFaceTokenizer needs --tokenizer-model (a local tokenizer.json or a directory "
            "holding one)"
        )
    if os.path.isdir(tokenizer_model):
        path = os.path.join(tokenizer_model, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model: no tokenizer.json in directory {tokenizer_model}")
        return path
    if not os.path.isfile(tokenizer_model):
        raise ValueError(
            f"--tokenizer-model: no such file or directory: {tokenizer_model} "
            "(only local files are loaded; nothing is downloaded)"
        )
    return str(tokenizer_model)


class HFTokenizer(MegatronTokenizerBase):
    """A ``tokenizers.Tokenizer`` with Megatron's tokenizer interface.

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        eod: id of the end-of-document token.
        tokenizer_type: the Megatron type name it was built as (for the cache key).
        paths: the files it was loaded from (for the cache key and for messages).
    """

    def __init__(self, tokenizer, eod: int, tokenizer_type: str, paths: Sequence[str]):
        super().__init__(str(paths[0]) if paths else "", {})
        self._tokenizer = tokenizer
        self._eod = int(eod)
        self.tokenizer_type = tokenizer_type
        # absolute, so that every rank derives the same dataset cache key whatever its cwd
        self.paths = [os.path.abspath(str(p)) for p in paths]
        self._pad = next(
            (i for i in (tokenizer.token_to_id(t) for t in _PAD_CANDIDATES) if i is not None),
            NO_PAD_ID,
        )
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.unique_identifiers = OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("tokenizer_type", tokenizer_type),
                ("tokenizer_path", self.paths),
                ("vocab_size", self._vocab_size),
                ("eod", self._eod),
            ]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @classmethod
    def from_file(cls, path: str, tokenizer_type: str = "HuggingFaceTokenizer") -> "HFTokenizer":
        """Load a ``tokenizer.json``; the EOD token comes from a ``tokenizer_config.json`` next to
        it (``eos_token``) or else the first of ``<|endoftext|>``, ``</s>``, ... in the vocab."""
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust error is multi-line JSON detail
            raise ValueError(
                f"--tokenizer-model: cannot read {path} as a tokenizer.json "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
        eod = _find_eod(tok, _configured_eos(os.path.dirname(os.path.abspath(path))))
        if eod is None:
            raise ValueError(
                f"--tokenizer-model: {path} has no end-of-document token "
                f"(looked for {', '.join(_EOD_CANDIDATES)} and tokenizer_config.json eos_token)"
            )
        return cls(tok, eod, tokenizer_type, [path])

    @classmethod
    def from_gpt2_files(cls, vocab_file: str, merge_file: str) -> "HFTokenizer":
        """OpenAI GPT-2 ``encoder.json`` + ``vocab.bpe`` as a byte-level BPE (GPT-2 regex split,
        no prefix space); ``<|endoftext|>`` is the EOD and is matched as one token in text."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:
            raise ValueError(
                f"--vocab-file/--merge-file: cannot read GPT-2 BPE files {vocab_file}, {merge_file} "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOD_TOKEN) is None:
            raise ValueError(f"--vocab-file: {vocab_file} has no {EOD_TOKEN} token")
        tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
        return cls(tok, tok.token_to_id(EOD_TOKEN), "GPT2BPETokenizer", [vocab_file, merge_file])

    # --- Megatron tokenizer interface -------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Text -> ids, without BOS/EOS or other post-processing."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (parallel inside ``tokenizers``); same ids as ``tokenize`` each."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict:
        """Token string -> id."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        """Id -> token string."""
        return {i: t for t, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """A dedicated pad token's id, or -1 (megatron-core's 'no pad token' id) when none."""
        return self._pad

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.tokenizer_type} ({self.path}) is a pretraining tokenizer without a chat template"
        )

    def __repr__(self) -> str:
        return f"{self.tokenizer_type}({', '.join(self.paths)}, vocab_size={self.vocab_size}, eod={self.eod})"


class NullTokenizer(MegatronTokenizerBase):
    """Ids as space-separated integers ("3 7 1" <-> [3, 7, 1]); EOD is ``vocab_size`` (the
    argument), so ``.vocab_size`` is ``vocab_size + 1``, as Megatron-LM's ``NullTokenizer``."""

    def __init__(self, vocab_size: int):
        super().__init__("", {})
        self._vocab_size_without_eod = int(vocab_size)
        self.tokenizer_type = "NullTokenizer"
        self.unique_identifiers = OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("vocab_size", self.vocab_size),
            ]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer input must be space-separated integers") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer id {bad[0]} is outside [0, {self.vocab_size})")
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> dict:
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict:
        return {i: str(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        return NO_PAD_ID

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("NullTokenizer has no chat template")

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size})"


def _configured_eos(directory: str) -> Optional[str]:
    """``eos_token`` of a ``tokenizer_config.json`` in ``directory``, if there is one."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _find_eod(tok, configured: Optional[str]) -> Optional[int]:
    for name in ((configured,) if configured else ()) + _EOD_CANDIDATES:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    return None
