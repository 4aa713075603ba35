#!/usr/bin/env python
"""imagetune's command line.

    python launch.py                                   the web UI on 127.0.0.1:7860
    python launch.py --preset PRESET [KEY=VALUE ...]   train headless with a progress bar
    python launch.py --preset PRESET --dry-run         print the resolved config and the plan; create nothing
    python launch.py --resume RUN_DIR [KEY=VALUE ...]  continue a run from its newest checkpoint
    python launch.py --import-kohya FILE.json|FILE.toml [--out P.yaml]   a preset from a kohya_ss / sd-scripts config
    python launch.py --import-ai-toolkit JOB.yaml [--out P.yaml]         a preset from an ai-toolkit job
    python launch.py --caption FOLDER [--captioner NAME_OR_PATH] [--prefix "sks, "] [--overwrite]
                                                       write a caption file beside every image of FOLDER
    python launch.py --push-to-hub RUN_DIR [REPO_ID]   upload a done run's outputs and model card to the Hub
    python launch.py --export RUN [--step N]           write a checkpoint's outputs (LoRA, model) into the run folder
    python launch.py --preset PRESET [...] --queue     add a run to the queue (runs/.queue/), validated now
    python launch.py --queue-worker                    start the queued runs as their devices come free, until none is left
    python launch.py --queue-list | --queue-move ENTRY up|down   show the queue; move a queued run

Exit status: 0 when the run is done or was stopped, 1 when it failed, 2 for a mistake in the command line or
the preset (reported as one paragraph, no traceback), 130 when interrupted before the run started.
This file only parses arguments and shows progress; the work is in trainer.core.launcher.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import trainer.families  # noqa: F401  (fills the family registry, trainer.core.registry)
from trainer.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch.py", description="Fine-tune image models. Without --preset or --resume, starts the web UI."
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="preset overrides, e.g. train.steps=500")
    p.add_argument("--preset", help="a preset YAML file, or the name of one in presets/")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest complete checkpoint")
    p.add_argument("--export", metavar="RUN",
                   help="write the outputs a finished run writes (LoRA files, full model, detector) from a checkpoint "
                        "of RUN (a run folder, or a run's name in --runs-dir) into RUN/output/step-NNNNNN/")
    p.add_argument("--step", type=int, metavar="N", help="with --export: the checkpoint's step (default: the newest)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan, then stop")
    p.add_argument("--queue", action="store_true",
                   help="with --preset: queue the run (it starts when the runs before it have ended) instead of now")
    p.add_argument("--queue-worker", action="store_true",
                   help="start the queued runs of --runs-dir as their devices come free (a run on GPUs 2,3 beside "
                        "one on GPUs 0,1), until the queue is empty and they have ended")
    p.add_argument("--queue-list", action="store_true", help="list the queued runs of --runs-dir, next first")
    p.add_argument("--queue-move", nargs=2, metavar=("ENTRY", "up|down"),
                   help="move a queued run (its position, name or id, as --queue-list shows) one place earlier or later")
    p.add_argument("--runs-dir", default="runs", help="where run folders are created (default: runs/)")
    bring = p.add_argument_group("import another trainer's config")
    bring.add_argument("--import-kohya", metavar="FILE", help="a kohya_ss GUI config (.json) or an sd-scripts "
                       "config (.toml, with the dataset config it names) -> an imagetune preset")
    bring.add_argument("--import-ai-toolkit", metavar="JOB", help="an ai-toolkit job file (.yaml) -> a preset")
    p.add_argument("--push-to-hub", nargs="+", metavar=("RUN_DIR", "REPO_ID"),
                   help="upload a done run's outputs, last samples and model card to a Hub repo (default: the run's "
                        "output.push_to_hub); the token from HF_TOKEN")
    bring.add_argument("--out", metavar="P.yaml", help="where to write the imported preset (default: "
                       "<name>.imagetune.yaml in the current folder)")
    cap = p.add_argument_group("auto-captioning")
    cap.add_argument("--caption", metavar="FOLDER", help="caption the images of FOLDER (sub-folders included) with a "
                     "vision-language model or a tagger: FOLDER/x.png -> FOLDER/x.txt")
    cap.add_argument("--captioner", metavar="NAME_OR_PATH", help="florence2 (default), florence2-base, qwen2.5-vl, "
                     "qwen3-vl, joycaption, wd-tagger, or any such model's folder or hub id owner/name")
    cap.add_argument("--prefix", default="", help="written before every caption, e.g. a trigger word: 'sks, '")
    cap.add_argument("--overwrite", action="store_true", help="replace existing captions (default: keep them)")
    cap.add_argument("--instruction", help="what a chat captioner is asked (Florence-2: its task token)")
    cap.add_argument("--threshold", type=float, help="a tagger's score threshold (default 0.35)")
    cap.add_argument("--caption-extension", default=".txt", help="the caption files' extension (data.caption_extension)")
    ui = p.add_argument_group("web UI")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=7860)
    ui.add_argument("--auth", metavar="USER:PASSWORD",
                    help="require this login; prefer the IMAGETUNE_AUTH environment variable (a command line is "
                         "visible to every user of the machine through ps)")
    ui.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                    help="also accept requests from pages at this origin (scheme://host[:port], e.g. a proxy's); "
                         "repeatable; IMAGETUNE_ALLOWED_ORIGINS takes a comma-separated list")
    ui.add_argument("--share", action="store_true", help="also serve through a public Gradio link")
    ui.add_argument("--insecure", action="store_true", help="allow a non-local host or --share without --auth")
    p.add_argument("--worker-module", default="trainer.engine.worker", help=argparse.SUPPRESS)  # tests' fake worker
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if sum(bool(x) for x in (args.preset, args.resume, args.export)) > 1:
            raise UserError("Use one of --preset (start a new run), --resume RUN_DIR (continue one) or --export RUN "
                            "(write a checkpoint's outputs), not several.")
        if args.queue and (not args.preset or args.dry_run):
            raise UserError("--queue goes with --preset (and without --dry-run): it queues that run.")
        if args.queue_worker and (args.preset or args.resume or args.export or args.overrides):
            raise UserError("--queue-worker takes only --runs-dir: it starts the runs already queued there "
                            "(queue them with --preset ... --queue).")
        if args.step is not None and not args.export:
            raise UserError("--step goes with --export RUN: it picks the checkpoint whose outputs to write.")
        if args.dry_run and not args.preset:
            raise UserError("--dry-run needs --preset: it shows what a preset would do without creating anything.")
        if args.import_kohya or args.import_ai_toolkit:
            return import_headless(args)
        if args.caption:
            return caption_headless(args)
        if args.captioner or args.prefix or args.overwrite or args.instruction or args.threshold is not None:
            raise UserError("--captioner, --prefix, --overwrite, --instruction and --threshold go with --caption "
                            "FOLDER: python launch.py --caption FOLDER --captioner NAME --prefix 'sks, '.")
        if args.push_to_hub:
            return push_headless(args)
        if args.out:
            raise UserError("--out names where an imported preset goes: use it with --import-kohya or "
                            "--import-ai-toolkit.")
        if args.queue_worker:
            return queue_worker(args)
        if args.queue_list or args.queue_move:
            return queue_edit(args)
        if args.preset:
            return run_headless(args)
        if args.resume:
            return resume_headless(args)
        if args.export:
            return export_headless(args)
        if args.overrides:
            raise UserError(f"KEY=VALUE overrides ({' '.join(args.overrides)}) need --preset or --resume.")
        return start_ui(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def find_preset(name: str) -> str:
    """A path as given, else `presets/<name>[.yaml]` shipped beside this file (a checkout or the installed
    package), so `--preset demo` works from any folder."""
    if Path(name).exists():
        return name
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


def import_headless(args) -> int:
    from trainer.core.importers import import_config

    if args.import_kohya and args.import_ai_toolkit or args.preset or args.resume or args.overrides or args.dry_run:
        raise UserError("An import runs alone: give one of --import-kohya / --import-ai-toolkit (and --out), then "
                        "run the preset it writes with --preset.")
    kind, path = ("kohya", args.import_kohya) if args.import_kohya else ("ai-toolkit", args.import_ai_toolkit)
    result = import_config(kind, path, args.out)
    print(f"wrote {result.out}")
    for note in result.imported.notes:
        print(f"note: {note}")
    if result.imported.unmapped:
        print(f"not imported ({len(result.imported.unmapped)}):")
        for key, why in result.imported.unmapped:
            print(f"  {key}: {why}")
    if result.problems:
        print("still to set before it runs:")
        for problem in result.problems:
            print(f"  - {problem}")
        print(f"then: python launch.py --preset {result.out} --dry-run")
    else:
        print(f"ready: python launch.py --preset {result.out} --dry-run")
    return 0


def caption_headless(args) -> int:
    """Caption files beside a folder's images. The folder and the captioner's name are checked here; the model
    loads in a process of its own (python -m trainer.captioning), so torch stays out of this one, as for export."""
    import os
    import subprocess

    from trainer.captioning.files import plan_work
    from trainer.captioning.registry import resolve

    if args.preset or args.resume or args.export or args.overrides or args.dry_run or args.queue:
        raise UserError("--caption runs alone: python launch.py --caption FOLDER [--captioner NAME_OR_PATH] "
                        "[--prefix 'sks, '] [--overwrite]; then train with --preset.")
    plan_work(args.caption, args.overwrite, args.caption_extension)  # refused before a model is fetched
    resolve(args.captioner, args.instruction, args.threshold)
    command = [sys.executable, "-m", "trainer.captioning", f"--prefix={args.prefix}",
               f"--caption-extension={args.caption_extension}"]
    for flag, value in (("--captioner", args.captioner), ("--instruction", args.instruction),
                        ("--threshold", args.threshold)):
        if value is not None:
            command.append(f"{flag}={value}")  # `=`: a prefix or instruction may start with a dash
    command += (["--overwrite"] if args.overwrite else []) + ["--", args.caption]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run(command, env=env).returncode


def push_headless(args) -> int:
    """A done run to the Hub after the fact: it was trained without output.push_to_hub, or its upload failed."""
    from trainer.core.config.load import load_config
    from trainer.core.events import final_event, read_events
    from trainer.core.hub import push_outputs
    from trainer.core.runfolder import RunFolder

    if len(args.push_to_hub) > 2 or args.preset or args.resume or args.overrides:
        raise UserError("--push-to-hub takes a run folder and, optionally, a repo id: "
                        "python launch.py --push-to-hub runs/<name> [user/name].")
    run_dir = Path(args.push_to_hub[0]).expanduser().resolve()
    folder = RunFolder(run_dir)
    final = final_event(read_events(run_dir)) if folder.config.is_file() else None
    if final is None or final["type"] != "done":
        raise UserError(f"--push-to-hub: {run_dir} is not a done run (its events.jsonl ends without `done`); only a "
                        "finished run's outputs are uploaded.")
    repo = args.push_to_hub[1] if len(args.push_to_hub) == 2 else None
    config = load_config(folder.config, [f"output.push_to_hub={repo}"] if repo else [], check_paths=False)
    if not config.output.push_to_hub:
        raise UserError("--push-to-hub: name the repo (python launch.py --push-to-hub RUN_DIR user/name): the run "
                        "has no output.push_to_hub.")
    print(f"uploading {folder.output} to {config.output.push_to_hub}", flush=True)
    try:
        url = push_outputs(config, run_dir, int(final.get("step") or 0))
    except Exception as exc:  # huggingface_hub's errors: rights, network; the first line says which
        raise UserError(f"--push-to-hub: uploading to {config.output.push_to_hub} failed ({type(exc).__name__}: "
                        f"{(str(exc).strip().splitlines() or [''])[0][:300]}). Check HF_TOKEN (a write token) and "
                        "the repo id.") from None
    print(f"uploaded: {url}")
    return 0


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
    changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in proc.changes.items())
    print(f"resuming {proc.run_dir} at step {proc.resumed_from.step}" + (f" ({changed})" if changed else ""))
    return follow(proc, start_step=proc.resumed_from.step, offset=offset)


def export_headless(args) -> int:
    import os
    import subprocess

    from trainer.core.events import EventFollower
    from trainer.core.outputs import labelled, pick_checkpoint
    from trainer.core.runfolder import CONFIG_FILE

    if args.overrides:
        raise UserError(f"--export takes no KEY=VALUE overrides ({' '.join(args.overrides)}): it writes the outputs "
                        "of the run as it was trained.")
    run_dir = Path(args.export)
    if not run_dir.is_dir() and (Path(args.runs_dir) / args.export).is_dir():
        run_dir = Path(args.runs_dir) / args.export  # a run's name, as the Runs tab lists it
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(f"--export {args.export}: no run folder there (a folder with {CONFIG_FILE}, as launch.py "
                        f"creates under {args.runs_dir}/). Give a run folder's path, or a run's name with --runs-dir.")
    run_dir = run_dir.resolve()
    step = pick_checkpoint(run_dir, args.step).step  # a wrong --step is refused before the model loads
    print(f"exporting the checkpoint of step {step} of {run_dir}", flush=True)
    follower = EventFollower(run_dir)
    follower.offset = (run_dir / "events.jsonl").stat().st_size if (run_dir / "events.jsonl").exists() else 0
    # The model loads in a process of its own (torch stays out of this one, as for training)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    code = subprocess.run([sys.executable, "-m", "trainer.engine.export", str(run_dir), "--step", str(step)],
                          env=env).returncode
    if code:
        return code
    event: dict = next((e for e in reversed(follower.poll()) if e.get("type") == "export" and e.get("step") == step), {})
    print(f"outputs of step {step}:")
    for line in labelled([run_dir / p for p in event.get("outputs") or ()], run_dir):
        print(f"  {line}")
    return 0


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


def start_ui(args) -> int:
    auth = None
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not (sep and user and password):
            raise UserError("--auth must look like user:password (both non-empty).")
        auth = (user, password)
        print("warning: --auth puts the password on the command line, where every user of this machine can read it "
              "(ps); set IMAGETUNE_AUTH=user:password in the environment instead.", file=sys.stderr)
    try:
        import app.main as ui
    except ModuleNotFoundError as exc:
        if exc.name in ("app", "app.main"):
            raise UserError(
                "The web UI (the app/ package) is not part of this installation. Train headless instead: "
                "python launch.py --preset presets/<name>.yaml (see --help)."
            ) from None
        if exc.name == "gradio":
            raise UserError("The web UI needs gradio: pip install 'imagetune[ui]', then run launch.py again.") from None
        raise
    # The login (--auth, else IMAGETUNE_AUTH) and the exposure rules are checked by app.main before anything is built.
    return ui.main(host=args.host, port=args.port, auth=auth, share=args.share, insecure=args.insecure,
                   runs_dir=args.runs_dir, allowed_origins=args.allowed_origin) or 0


def cli() -> None:
    """The `imagetune` command (pyproject's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
