"""What the per-rank telemetry of a step is, and when a rank lags: torch-free, so that the web UI reads it too.

Measured by each rank (trainer.engine.telemetry.RankClock), carried by the step's all-reduce, summarised here
into the `progress` event. The slowest rank is named (`slowest_rank`) when its own work (input wait + forward
pass, the part no other rank waits inside) exceeds the median rank's by more than `LAG_MARGIN` of the step time:
a rank that costs every other rank a tenth of each step is worth a look (its data, its GPU's clocks, its host).
The backward pass is not counted: under DDP the fast ranks wait for the slow one inside it, so every rank's
backward looks as long.
"""

from __future__ import annotations

FIELDS = ("step_s", "data_s", "forward_s", "sync_s", "cpu_s", "rss_mb", "peak_rss_mb", "mem_mb", "util")
"""Per rank: the step's wall time, its input wait, forward pass and final all-reduce (s), the process's CPU time
in the step (s), resident memory now and at peak (MiB), peak device memory since the start (MiB; GPUs) and GPU
utilisation (% over NVML's last sample window; GPUs with pynvml)."""
WIDTH = len(FIELDS)
LAG_MARGIN = 0.10
"""Name the slowest rank when its input wait + forward exceed the median rank's by this fraction of the step."""


def summarize(slots: list[float], world_size: int) -> dict:
    """The `progress` event's per-rank fields from the all-reduced slots: `ranks` (one dict per rank, figures
    that do not apply left out), `data_s` (the longest input wait) and `slowest_rank` when one lags."""
    ranks = []
    for rank in range(world_size):
        values = slots[rank * WIDTH:(rank + 1) * WIDTH]
        entry: dict = {"rank": rank}
        for name, value in zip(FIELDS, values):
            if value >= 0:
                entry[name] = round(value, 1 if name.endswith("_mb") or name == "util" else 4)
        ranks.append(entry)
    out: dict = {"ranks": ranks, "data_s": max(r["data_s"] for r in ranks)}
    slowest = lagging_rank(ranks)
    if slowest is not None:
        out["slowest_rank"] = slowest
    return out


def lagging_rank(ranks: list[dict]) -> int | None:
    """The rank whose input wait + forward exceed the median rank's by more than LAG_MARGIN of the step time."""
    if len(ranks) < 2:
        return None
    own = sorted((r["data_s"] + r["forward_s"], r["rank"]) for r in ranks)
    median = own[(len(own) - 1) // 2][0]
    step = max(r["step_s"] for r in ranks)
    worst, rank = own[-1]
    return rank if step > 0 and worst - median > LAG_MARGIN * step else None
