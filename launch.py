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
This file only parses the arguments; the commands are trainer.cli's (what a run shows while it trains is
trainer.cli.follow), the work trainer.core.launcher's.
"""

from __future__ import annotations

import argparse
import sys

import trainer.families  # noqa: F401  (fills the family registry, trainer.core.registry)
from trainer.cli.runs import queue_edit, queue_worker, resume_headless, run_headless
from trainer.cli.tools import caption_headless, export_headless, import_headless, push_headless
from trainer.errors import UserError


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
