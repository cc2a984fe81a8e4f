'''Field docstrings: the string literal right under a class attribute, as the one source of its help.

A config dataclass documents each field where it is declared::

    @dataclasses.dataclass
    class TrainingConfig:
        lr: float = 3e-4
        """peak learning rate"""

Python keeps no such string at run time, so ``field_docs`` reads it from the class's source (vLLM's
``get_attr_docs`` does the same for its config classes); the argument parser's ``--help`` and the
generated reference take a flag's text from there. Standard library only.
'''

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

__all__ = ["field_docs"]


@functools.lru_cache(maxsize=None)
def _own_docs(cls: type) -> dict:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source: a class made at run time, or only bytecode shipped
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    docs = {}
    for statement, following in zip(node.body, node.body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def field_docs(cls: type) -> dict:
    """``{attribute: docstring}`` of ``cls`` and its bases (a subclass's own text wins), each
    docstring on one line (its whitespace runs collapsed to single spaces)."""
    out: dict = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            out.update(_own_docs(klass))
    return out
