"""Checkpoint conversion between Hugging Face model directories and this project's checkpoints.

``import_hf(hf_dir, out, ...)`` and ``export_hf(load, out, ...)`` (``hf_mcore.py``); one module per
model family in ``families/`` (the registry finds them); tensor rules in ``rules.py``; HF file
reading/writing in ``hf_io.py``. Command line: ``python -m distill.convert`` (``__main__.py``).
"""

from distill.convert.hf_mcore import TensorMismatch, export_hf, import_hf

__all__ = ["import_hf", "export_hf", "TensorMismatch"]
