"""The run queue as the Runs tab shows it (trainer.core.queue keeps it in the runs folder): one `queued #N` row
per waiting run at the top of the runs table, and the choices of the Cancel control. Torch-free."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.core import queue


def _summary(path: Path) -> tuple[str, str]:
    """(family, method) of a queued config; blanks if it cannot be read (it is validated again at its start)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return str((data.get("model") or {}).get("family", "")), str(data.get("method", ""))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return "", ""


def queue_rows(runs_dir: str | Path) -> list[list]:
    """Rows of the runs table (app.runs.RUN_COLUMNS) for the queued runs, next first."""
    import time

    rows = []
    for q in queue.entries(runs_dir):
        family, method = _summary(q.path)
        queued = time.strftime("%Y-%m-%d %H:%M", time.localtime(int(q.id.split("-")[0]) / 1e9))
        rows.append([q.name, family, method, f"queued #{q.position}", "", "", queued])
    return rows


def queue_choices(runs_dir: str | Path) -> list[tuple[str, str]]:
    """(label, entry id) of each queued run, for the Cancel control."""
    return [(f"#{q.position} {q.name}", q.id) for q in queue.entries(runs_dir)]


def queue_stamp(runs_dir: str | Path) -> int:
    """Changes when a run is queued, cancelled or taken (the queue folder's mtime); 0 without a queue."""
    try:
        return queue.queue_dir(runs_dir).stat().st_mtime_ns
    except OSError:
        return 0
