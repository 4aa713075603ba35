"""What a headless run shows in the terminal while it trains: the plan, a progress bar (or, for the queue worker,
lines named by the run), the samples, checkpoints, evaluations and warnings as they arrive, and how it ended.
Torch-free: it reads the run folder's events (trainer.core.events)."""

from __future__ import annotations

import signal
import sys
import time


def print_plan(plan) -> None:
    print(f"plan: {plan.line()}")
    if plan.memory:
        print(f"memory: {plan.memory}")
    if plan.caches:
        print(f"caches: {plan.caches}")
    for note in plan.notes:
        print(f"note: {note}")
    sys.stdout.flush()


def follow(proc, start_step: int, offset: int) -> int:
    """Show the run's events until its final one; Ctrl-C/SIGTERM asks for a graceful stop, twice kills."""
    from tqdm import tqdm

    from trainer.core.events import EventFollower

    signals: list[int] = []  # the handler only records: printing from a signal handler can re-enter print()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    follower = EventFollower(proc.run_dir)
    follower.offset = offset
    bar = tqdm(total=proc.plan.steps, initial=start_step, unit="step", dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")
    handled, final = 0, None
    try:
        while True:
            if len(signals) > handled:
                handled = len(signals)
                if handled == 1:
                    proc.request_stop()
                    bar.write("stopping: saving a checkpoint at the end of this step (Ctrl-C again to kill the run)")
                else:
                    bar.write("killing the run (no checkpoint)")
                    proc.kill(grace_s=5)
            for event in follower.poll():
                final = show(event, bar, proc) or final
            if proc.poll() is not None:
                proc.wait()  # writes `failed` if the workers died without a final event
                for event in follower.poll():
                    final = show(event, bar, proc) or final
                break
            time.sleep(0.2)
    finally:
        bar.close()
    if final is None:
        from trainer.core.events import final_event, read_events

        final = final_event(read_events(proc.run_dir)) or {"type": "failed", "reason": "no final event was written"}
    return report(final, proc)


def show(event: dict, bar, proc) -> dict | None:
    kind = event.get("type")
    if kind == "progress":
        from trainer.core.runlog import duration  # the same h:mm:ss as train.log's lines

        bar.total = event.get("steps", bar.total)
        bar.update(event["step"] - bar.n)
        rate = event.get("samples_per_s")
        parts = [f"loss {event['loss']:.4f}" if event.get("loss") is not None else None,
                 f"lr {event['lr']:.2e}" if event.get("lr") is not None else None,
                 f"{rate / proc.plan.total:.2f} it/s" if rate else None,
                 f"ETA {duration(event.get('eta_s'))}"]
        bar.set_postfix_str(" · ".join(p for p in parts if p))
    elif kind == "warning":
        bar.write(f"warning: {event.get('message')}")
    elif kind == "sample":
        bar.write(f"sample (step {event.get('step')}): {proc.run_dir / event.get('path', '')}")
    elif kind == "checkpoint":
        bar.write(f"checkpoint (step {event.get('step')}): {proc.run_dir / event.get('path', '')}")
    elif kind == "eval":
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in event.items() if isinstance(v, float) and k != "time")
        bar.write(f"eval (step {event.get('step')}): {metrics}")
    elif kind in ("done", "stopped", "failed"):
        return event
    return None


def report(final: dict, proc) -> int:
    kind = final["type"]
    if kind == "done":
        from trainer.core.outputs import labelled

        outputs = final.get("outputs") or []
        shown = labelled([proc.run_dir / p for p in outputs], proc.run_dir)
        print("done." + (" outputs:\n  " + "\n  ".join(shown) if outputs else ""))
        if final.get("message"):
            print(final["message"])
        return 0
    if kind == "stopped":
        print(f"stopped at step {final.get('step', '?')}. Continue with: python launch.py --resume {proc.run_dir}")
        return 0
    print(f"failed: {final.get('reason', 'no reason given')}", file=sys.stderr)
    return 1


class RunLines:
    """`show`'s progress bar for the queue worker, whose runs may train side by side: lines named by the run, and
    a progress line at each tenth of the steps."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.n, self._tenth = name, total, 0, 0

    def write(self, line: str) -> None:
        print(f"{self.name}: {line}", flush=True)

    def update(self, by: int) -> None:
        self.n += by

    def set_postfix_str(self, text: str) -> None:
        tenth = self.n * 10 // max(1, self.total)
        if tenth > self._tenth:
            self._tenth = tenth
            self.write(f"step {self.n}/{self.total} · {text}")

