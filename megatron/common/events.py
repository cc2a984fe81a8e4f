"""Events: points in a loop that code outside the loop subscribes to.

The training loop emits ``megatron.training.training.STEP_END`` after every step and the serving
loop ``megatron.inference.loop.STEP_END`` after every engine step. A tool subscribes from outside
(``tools.faults.rank`` injects faults there) instead of the loop calling the tool. Subscribers run
on the loop's thread, in the order they subscribed; an exception in one propagates into the loop,
as any exception in a step would. Standard library only.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["Event"]


class Event:
    """A named point in a loop: ``subscribe(fn)`` (returns the function that unsubscribes it),
    ``emit(*args)`` calls every subscriber with ``args``."""

    def __init__(self, name: str):
        self.name = name
        self._subscribers: list = []

    def subscribe(self, fn: Callable) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def emit(self, *args) -> None:
        for fn in list(self._subscribers):
            fn(*args)

    def __repr__(self) -> str:
        return f"Event({self.name!r}, {len(self._subscribers)} subscriber(s))"
