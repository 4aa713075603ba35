"""`key()`: a documented config field. The schema (schema.py) and the families' own config sections
(trainer/core/config/sections/) are written with it; its `help` is the key's documentation, shown next to its
field in the web UI. A help that lists the registered families' data is a function, called when read (`help_of`):
the schema is imported before any family has registered (trainer.core.registry)."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Callable


def key(default: Any, help: str | Callable[[], str], *, choices: tuple[str, ...] | None = None, group: str | None = None):
    """A documented config field. Lists/dicts are copied per instance."""
    meta = {"help": help, "choices": choices, "group": group}
    if isinstance(default, (list, dict)):
        def fresh() -> Any:
            return type(default)(default)
        return field(default_factory=fresh, metadata=meta)
    return field(default=default, metadata=meta)


def help_of(f: Any) -> str:
    """The documentation of field `f` (a dataclasses.Field made by `key`)."""
    text = f.metadata.get("help", "")
    return text() if callable(text) else text
