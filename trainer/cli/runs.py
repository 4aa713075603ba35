"""The headless commands that start runs: a preset now (with a progress bar) or into the queue, a resume, the
queue's worker and its list. `launch.py` parses the command line and calls these."""

from __future__ import annotations

import signal
from pathlib import Path

from trainer.cli.follow import RunLines, follow, print_plan, report, show
from trainer.errors import UserError


def find_preset(name: str) -> str:
    """A path as given, else `presets/<name>[.yaml]` shipped beside launch.py (a checkout, or site-packages for
    the installed package), so `--preset demo` works from any folder."""
    if Path(name).exists():
        return name
    from trainer.core.launcher import REPO_ROOT

    for candidate in (REPO_ROOT / "presets" / name, REPO_ROOT / "presets" / f"{name}.yaml"):
        if candidate.is_file():
            return str(candidate)
    return name  # read_preset explains that it does not exist


def slurm_overrides(overrides: list[str]) -> tuple[list[str], str]:
    """Inside `srun` or a Kubernetes indexed Job's pod: the cluster's nodes, node rank, master host and GPUs as
    overrides before the user's own (which win), and the words for the plan line; elsewhere, nothing
    (trainer.core.slurm, trainer.core.kubernetes)."""
    import os

    from trainer.core.kubernetes import kubernetes_pod
    from trainer.core.slurm import slurm_step

    step = slurm_step(os.environ) or kubernetes_pod(os.environ)
    if step is None:
        return list(overrides), ""
    return [*step.overrides(), *overrides], step.describe()


def run_headless(args) -> int:
    from dataclasses import replace

    from trainer.core.config import load_config, to_yaml
    from trainer.core.launcher import check_data, plan_for

    overrides, cluster = slurm_overrides(args.overrides)
    config = load_config(find_preset(args.preset), overrides)
    if args.dry_run:
        plan = replace(plan_for(config), cluster=cluster)
        # The dataset's buckets and the caches' figures, from a scan of its files (nothing is written; a demo://
        # dataset is not built for a dry run, so it has none)
        folders = [config.data.path, *(entry.path for entry in config.data.datasets or ())]
        if not any(str(folder).startswith("demo://") for folder in folders):
            scan = check_data(config)
            plan = plan.with_buckets(config, scan).with_held_out(scan).with_caches(config, scan)
        print(to_yaml(config), end="")
        print_plan(plan)
        return 0
    if args.queue:
        from trainer.core import queue

        entry = queue.add(args.runs_dir, config)
        print(f"queued {entry.name} at position {entry.position} ({entry.path}); `python launch.py --queue-worker "
              f"--runs-dir {args.runs_dir}` starts the queued runs")
        return 0
    return start_and_follow(config, args, cluster)


def start_and_follow(config, args, cluster: str = "") -> int:
    from trainer.core.launcher import prepare_run, start_run

    run_dir, plan = prepare_run(config, args.runs_dir, cluster=cluster)
    print_plan(plan)
    print(f"run folder: {run_dir}", flush=True)
    proc = start_run(run_dir, plan, config, worker_module=args.worker_module)
    return follow(proc, start_step=0, offset=0)


def resume_headless(args) -> int:
    from trainer.core.runfolder import EVENTS_FILE
    from trainer.core.resume import resume_run

    events = Path(args.resume) / EVENTS_FILE
    offset = events.stat().st_size if events.exists() else 0  # show only what this launch adds
    overrides, cluster = slurm_overrides(args.overrides)
    proc = resume_run(args.resume, overrides, worker_module=args.worker_module)
    print_plan(proc.plan)
    if cluster:
        print(f"note: {cluster}")
    checkpoint = proc.resumed_from
    assert checkpoint is not None, "resume_run names the checkpoint it resumed from"
    changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in proc.changes.items())
    print(f"resuming {proc.run_dir} at step {checkpoint.step}" + (f" ({changed})" if changed else ""))
    return follow(proc, start_step=checkpoint.step, offset=offset)


def queue_edit(args) -> int:
    """--queue-move ENTRY up|down, then (or for --queue-list) the queue as it is."""
    from trainer.core import queue

    if args.queue_move:
        which, direction = args.queue_move
        if direction not in ("up", "down"):
            raise UserError(f"--queue-move {which} {direction}: the direction is `up` (earlier) or `down` (later).")
        queued = queue.entries(args.runs_dir)
        entry = next((q for q in queued if which in (q.id, q.name, str(q.position), f"#{q.position}")), None)
        if entry is None:
            raise UserError(f"--queue-move: no queued run {which!r} in {args.runs_dir} (--queue-list shows them).")
        if queue.move(args.runs_dir, entry.id, -1 if direction == "up" else 1) is None:
            print(f"{entry.name} stays at #{entry.position}: it is already {'first' if direction == 'up' else 'last'}"
                  " (or has started)")
    queued = queue.entries(args.runs_dir)
    for q in queued:
        print(f"#{q.position}  {q.name}  ({q.id})")
    if not queued:
        print(f"the queue of {args.runs_dir} is empty")
    return 0


def queue_worker(args) -> int:
    """Start the queued runs as their devices come free (trainer.core.queue.drain), several at once when they need
    different GPUs; each run's lines carry its name."""
    from trainer.core import queue
    from trainer.core.events import EventFollower
    from trainer.core.launcher import prepare_run, start_run

    followed: dict[int, tuple[EventFollower, RunLines]] = {}
    started: list = []

    def launch(config):
        run_dir, plan = prepare_run(config, args.runs_dir)
        print_plan(plan)
        print(f"run folder: {run_dir}", flush=True)
        proc = start_run(run_dir, plan, config, worker_module=args.worker_module)
        followed[id(proc)] = (EventFollower(run_dir), RunLines(run_dir.name, plan.steps))
        started.append(proc)
        return proc

    def poll(proc) -> int | None:
        follower, lines = followed[id(proc)]
        ended = proc.poll() is not None
        final = proc.wait() if ended else None  # writes `failed` if the workers died without a final event
        for event in follower.poll():
            final = show(event, lines, proc) or final
        if not ended:
            return None
        print(f"{proc.run_dir.name}: ", end="")
        return report(final or {"type": "failed", "reason": "no final event was written"}, proc)

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        failures = queue.drain(args.runs_dir, launch, poll, say=lambda line: print(f"queue: {line}", flush=True))
    except KeyboardInterrupt:  # as for one run (follow): a graceful stop of the runs it started, twice kills
        live = [proc for proc in started if proc.poll() is None]
        print(f"queue: interrupted; stopping the {len(live)} run(s) this worker started at their next step (Ctrl-C "
              "again to kill them); the queued runs stay queued", flush=True)
        for proc in live:
            proc.request_stop()
        try:
            for proc in live:
                proc.wait()
        except KeyboardInterrupt:
            for proc in live:
                proc.kill(grace_s=5)
        return 130
    print(f"queue: empty ({failures} run(s) did not end well)" if failures else "queue: empty")
    return 1 if failures else 0

