"""What a run folder's config.yaml must hold for the Runs page to show it (events.jsonl's fields are checked by
their own types: trainer.core.event_types.parse).

A folder holding anything else (a config.yaml that is a string, `train.steps: auto`, bytes that are not UTF-8) is
refused with `Unreadable` naming the file and field, and app.runs shows that run as "unreadable: <reason>" on its own row: one broken or planted folder must
not break the page (and its periodic refresh) for every other run.
"""

from __future__ import annotations

from pathlib import Path

import yaml

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
