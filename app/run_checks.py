"""What a run folder must hold for the Runs page to show it: the types its numbers and paths are computed with.

A folder holding anything else (a config.yaml that is a string, `train.steps: auto`, a loss that is text, a
sample path that is not a file name, bytes that are not UTF-8) is refused with `Unreadable` naming the file and
field, and app.runs shows that run as "unreadable: <reason>" on its own row: one broken or planted folder must
not break the page (and its periodic refresh) for every other run.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.core.events import EVENTS_FILE
from trainer.core.runfolder import CONFIG_FILE


class Unreadable(ValueError):
    """A run folder holds something the page cannot show (wrong types, bad encoding)."""


def config_summary(run_dir: Path) -> dict:
    try:
        data = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    except OSError:
        return {}
    except (yaml.YAMLError, ValueError) as exc:
        raise Unreadable(f"{CONFIG_FILE} is not valid YAML/UTF-8 ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(data, dict):
        raise Unreadable(f"{CONFIG_FILE} is not a mapping of keys")
    return data


def section(config: dict, key: str) -> dict:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise Unreadable(f"{CONFIG_FILE}: {key} is not a mapping")
    return value


def number_or_zero(value, what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unreadable(f"{what} is {value!r}, not a number")
    return int(value)


def number(value, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unreadable(f"{what} is {value!r}, not a number")
    return float(value)


_NUMBERS = ("time", "loss", "lr", "samples_per_s", "eta_s", "total", "data_s")
_INTS = ("step", "steps", "index", "ranks_step", "slowest_rank")


def checked_event(event: dict) -> dict:
    """`event` if its fields have the types the page computes with; else Unreadable naming the field."""
    kind = event.get("type")
    for key in _NUMBERS:
        number(event.get(key), f"{EVENTS_FILE}: a {kind} event's {key}")
    for key in _INTS:
        number_or_zero(event.get(key), f"{EVENTS_FILE}: a {kind} event's {key}")
    path = event.get("path") if kind == "sample" else None
    if path is not None and (not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts):
        raise Unreadable(f"{EVENTS_FILE}: a sample event's path is {path!r}, not a file in the run folder")
    if isinstance(event.get("plan"), dict):
        checked_event(event["plan"])
    ranks = event.get("ranks")
    if ranks is not None:  # the page prints these: numbers only (trainer.engine.telemetry)
        if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
            raise Unreadable(f"{EVENTS_FILE}: a {kind} event's ranks is {ranks!r}, not a list of figures")
        for figures in ranks:
            for name, value in figures.items():
                number(value, f"{EVENTS_FILE}: a {kind} event's ranks.{name}")
    for key in ("plan", "notes", "line", "reason", "message"):
        value = event.get(key)
        expected = {"plan": dict, "notes": list}.get(key, str)
        if value is not None and not isinstance(value, expected):
            raise Unreadable(f"{EVENTS_FILE}: a {kind} event's {key} is {value!r}")
    return event
