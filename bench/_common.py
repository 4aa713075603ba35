"""Helpers shared by the benchmarks (not part of the product).

Run as a module (`python -m bench._common RUN_DIR ...`) this is the engine's own worker, `trainer.engine.worker.main`,
unchanged, plus two pieces of bookkeeping: it reads the process's CPU-time clock (and getrusage) at every
`progress` event, and it writes that and its peak memory to `RUN_DIR/bench-memory-rank<R>.json` before exiting.
bench/engine_overhead.py hands it to `trainer.core.launcher.start_run(worker_module=...)`, so the launcher -> torchrun
-> worker path is exactly the product's, and the worker's CUDA peak (which no outside process can read) is
still measured.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import trainer.families  # noqa: F401  (fills the family registry, trainer.core.registry)

REPO_ROOT = Path(__file__).resolve().parents[1]
MEMORY_FILE = "bench-memory-rank{rank}.json"


def max_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size in MiB (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    value = resource.getrusage(who).ru_maxrss
    return round(value / (2**20 if sys.platform == "darwin" else 2**10), 1)


def vm_hwm_mb(pid: int) -> float | None:
    """The kernel's peak-RSS mark (VmHWM) of a live process, in MiB; None if unreadable (not Linux, gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a live process so far (Linux /proc); None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (through /proc; psutil when /proc is missing)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        pass
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def usage_mark() -> list[float]:
    """[user CPU s, system CPU s, minor page faults, involuntary context switches (preempted), voluntary context
    switches (blocked: waiting for another thread, a lock, I/O)] of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return [r.ru_utime, r.ru_stime, float(r.ru_minflt), float(r.ru_nivcsw), float(r.ru_nvcsw)]


def cuda_peak_mb() -> float | None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    except Exception:
        pass
    return None


def _vm_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples this process's RSS every `interval` s in a daemon thread: a second source next to the kernel's
    high-water mark (VmHWM, ru_maxrss), which can miss memory handed back by madvise. They agreed here. (An
    outside poll that keeps reading until the process is gone sees ~100 MB more: Python's interpreter teardown,
    after the report.)"""

    def __init__(self, interval: float = 0.05):
        import threading

        self.peak = 0.0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            value = _vm_rss_mb()
            if value is not None and value > self.peak:
                self.peak = value

    def stop(self) -> float:
        self._stop.set()
        return round(self.peak, 1)


_SAMPLER: RssSampler | None = None


def start_rss_sampler() -> None:
    global _SAMPLER
    _SAMPLER = RssSampler()


def memory_report() -> dict:
    """This process's peak RSS and CUDA peak (max_memory_allocated), in MiB. Peak RSS: the largest of VmHWM,
    ru_maxrss and the sampled VmRSS (see RssSampler)."""
    hwm = vm_hwm_mb(os.getpid())
    sampled = _SAMPLER.stop() if _SAMPLER is not None else None
    candidates = [v for v in (hwm, max_rss_mb(), sampled) if v is not None]
    return {"pid": os.getpid(), "max_rss_mb": max(candidates), "vm_hwm_mb": hwm, "ru_maxrss_mb": max_rss_mb(),
            "sampled_rss_mb": sampled, "cuda_max_allocated_mb": cuda_peak_mb()}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.{digits}f}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _worker_main() -> int:
    """trainer.engine.worker.main, plus clock reads at every `progress` event and a report when the process ends."""
    t_start = time.time()
    start_rss_sampler()
    # The modules the worker's setup() imports anyway, imported first so that startup splits into imports and
    # setup (the same work; nothing else changes).
    import accelerate
    import torch

    try:
        import trainer.families.sd.family
    except Exception:  # noqa: S110  (a broken family fails again, with the engine's own message, in main())
        pass
    import trainer.core.events
    import trainer.engine.loop

    del accelerate, torch
    from trainer.engine.worker import main

    t_imported = time.time()
    # The process's CPU time (all threads) at every `progress` event: one clock read per optimizer step, so a
    # CPU-time-per-step figure that other tenants of a shared machine disturb far less than wall-clock time.
    cpu_marks: list[float] = []
    usage_marks: list[list[float]] = []
    emit = trainer.core.events.EventLog.emit

    def emit_with_cpu_time(self, typed) -> dict:
        if typed.kind == "progress":
            cpu_marks.append(time.process_time())
            usage_marks.append(usage_mark())
        return emit(self, typed)

    trainer.core.events.EventLog.emit = emit_with_cpu_time
    code = 1
    try:
        code = main(sys.argv[1:])
    finally:
        run_dir = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path.cwd()
        rank = os.environ.get("RANK", "0")
        report = {**memory_report(), "cpu_marks": cpu_marks, "usage_marks": usage_marks,
                  "cpu_total_s": time.process_time(), "t_start": t_start, "t_imported": t_imported}
        try:
            (run_dir / MEMORY_FILE.format(rank=rank)).write_text(json.dumps(report) + "\n")
        except OSError:
            pass
    return code


if __name__ == "__main__":
    sys.exit(_worker_main())


def compile_repeated_blocks(network, *, shapes: int = 16) -> int:
    """`train.compile`'s regional compilation (trainer/engine/compile.py), for the GPU benches' own loops: each of
    the network's repeated blocks compiled in place with static shapes, dynamo's recompile limit raised for
    `shapes` input shapes; returns how many blocks."""
    from trainer.engine.compile import block_names, raise_recompile_limit

    names = block_names(network)
    blocks: dict = {}
    for module in network.modules():
        if type(module).__name__ in names:
            blocks.setdefault(type(module).__name__, []).append(module)
    for modules in blocks.values():
        for module in modules:
            module.compile(dynamic=False)
    raise_recompile_limit(blocks, shapes=shapes)
    return sum(len(modules) for modules in blocks.values())
