"""Reversible patches of methods, shared by the platform's fixes."""
from __future__ import annotations

import functools
from typing import Callable


def wrap_method(cls, name: str, make: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Replaces ``cls.name`` by ``make(original)``; the undo restores the original, or, when
    another fix has wrapped the method since, turns this wrapper into a pass-through (so fixes
    on one method can be reverted in any order)."""
    original = cls.__dict__[name]
    state = {"on": True}
    fixed = make(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return (fixed if state["on"] else original)(*args, **kwargs)

    setattr(cls, name, wrapper)

    def undo() -> None:
        if cls.__dict__.get(name) is wrapper:
            setattr(cls, name, original)
        state["on"] = False

    return undo
