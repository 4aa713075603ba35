"""`key()`: a documented config field. The schema (schema.py) and the families' own config sections
(trainer/families/<family>/config.py) are written with it; its `help` is the key's documentation, shown next to
its field in the web UI."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def key(default: Any, help: str, *, choices: tuple[str, ...] | None = None, group: str | None = None):
    """A documented config field. Lists/dicts are copied per instance."""
    meta = {"help": help, "choices": choices, "group": group}
    if isinstance(default, (list, dict)):
        def fresh() -> Any:
            return type(default)(default)
        return field(default_factory=fresh, metadata=meta)
    return field(default=default, metadata=meta)
