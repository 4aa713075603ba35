"""The headless commands around training: import another trainer's config, caption a folder, export a
checkpoint's outputs, upload a done run to the Hub. Whatever loads a model runs in a process of its own
(`python -m trainer.captioning`, `-m trainer.engine.export`), so the command line stays torch-free."""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.errors import UserError


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
    import subprocess

    from trainer.captioning.files import plan_work
    from trainer.core.launcher import repo_env
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
    env = repo_env()
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


def export_headless(args) -> int:
    import subprocess

    from trainer.core.events import EventFollower
    from trainer.core.launcher import repo_env
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
    env = repo_env()
    code = subprocess.run([sys.executable, "-m", "trainer.engine.export", str(run_dir), "--step", str(step)],
                          env=env).returncode
    if code:
        return code
    event: dict = next((e for e in reversed(follower.poll()) if e.get("type") == "export" and e.get("step") == step), {})
    print(f"outputs of step {step}:")
    for line in labelled([run_dir / p for p in event.get("outputs") or ()], run_dir):
        print(f"  {line}")
    return 0

