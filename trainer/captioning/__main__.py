"""`python -m trainer.captioning FOLDER [...]`: the process that loads a captioner and captions a folder.

launch.py --caption checks the folder and the captioner's name, then starts this (the model and torch load here,
as a run's do in its worker), so launch.py and the UI that starts it stay torch-free. Exit 2 with one paragraph
for a mistake the user can fix (an unloadable model), 1 when no image could be read.
"""

from __future__ import annotations

import argparse
import signal
import sys

from trainer.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.captioning")
    p.add_argument("folder")
    p.add_argument("--captioner")
    p.add_argument("--prefix", default="")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--instruction")
    p.add_argument("--threshold", type=float)
    p.add_argument("--caption-extension", default=".txt")
    return p.parse_args(argv)


def _stop(signum, _frame) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: the caption being written is dropped whole, the model released


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from trainer.captioning.models import load
        from trainer.captioning.registry import resolve
        from trainer.captioning.run import caption_folder

        spec = resolve(args.captioner, args.instruction, args.threshold)
        result = caption_folder(args.folder, spec, load, args.prefix, args.overwrite, extension=args.caption_extension,
                                say=lambda line: print(line, flush=True))  # the UI follows the lines as they come
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: the captions written so far are kept", flush=True)
        return 130
    print(f"captioned {len(result.written)} image(s), kept {len(result.kept)} existing caption(s)"
          + (f", {len(result.failed)} unreadable" if result.failed else ""), flush=True)
    return 1 if result.failed and not result.written else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)  # the UI's Stop (set here, not in main: tests call main in process)
    sys.exit(main())
