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


def run_uncompiled(owner, name: str) -> Callable[[], None]:
    """Replaces ``owner.name``, a function megatron's ``jit_fuser`` wrapped in torch.compile, by
    the same Python function uncompiled (on the CPU its first call would compile it with
    inductor in every process); the undo puts the compiled one back. A function that is not
    compiled (``jit_fuser`` a no-op in this process) is left alone."""
    compiled = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None) or getattr(compiled, "__wrapped__", None)
    if eager is None:
        return lambda: None
    setattr(owner, name, eager)
    return lambda: setattr(owner, name, compiled)
