"""Runs a training script unmodified, with clock reads at a few library calls (not part of the product).

    python bench/_clocked_script.py MARKS_JSON SCRIPT [SCRIPT ARGS...]

bench/vs_diffusers.py starts diffusers' `train_dreambooth_lora.py` through this instead of `python SCRIPT`, because
the script writes no timestamps of its own (imagetune's run writes events with times). The script is executed by
`runpy.run_path(SCRIPT, run_name="__main__")` with `sys.argv = [SCRIPT, *ARGS]` and `sys.path[0]` set to the
script's folder, as `python SCRIPT ARGS` would; its text is not touched. Before it runs, a few library functions it
calls are wrapped so that each call appends `(name, time.time())` to a list:

- `main`: the first `accelerate.Accelerator()` (the script's `main()` has started: imports and argument parsing
  are over);
- `loop_start`: the creation of the tqdm bar named "Steps" (right before the training loop);
- `step`: every `update()` of that bar (the script calls it once per optimizer step, after the update and before
  that step's checkpoint);
- `checkpoint_begin` / `checkpoint_end`: around `Accelerator.save_state` (the script's checkpoints);
- `pipeline_load`: `DiffusionPipeline.from_pretrained` (the start of each validation, and of the final one);
- `free_memory`: the return of `diffusers.training_utils.free_memory` (the script calls it at the end of each
  validation);
- `end_training`: `Accelerator.end_training` (the script's last call).

The list is written to MARKS_JSON from an `atexit` hook, with `t_start` (this file's first line). The wrappers cost
microseconds per call; importing tqdm, accelerate and diffusers here instead of in the script moves that import
time earlier in the same process, it does not add any.
"""

import time

T_START = time.time()

import atexit
import json
import os
import runpy
import sys

MARKS: list[tuple[str, float]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.time()))


def _install() -> None:
    import tqdm.std

    update, init = tqdm.std.tqdm.update, tqdm.std.tqdm.__init__

    def tqdm_init(self, *args, **kwargs):
        if kwargs.get("desc") == "Steps":
            mark("loop_start")
        init(self, *args, **kwargs)

    def tqdm_update(self, n=1):
        if getattr(self, "desc", None) == "Steps":
            mark("step")
        return update(self, n)

    tqdm.std.tqdm.__init__, tqdm.std.tqdm.update = tqdm_init, tqdm_update

    import accelerate

    acc = accelerate.Accelerator
    acc_init, save_state, end_training = acc.__init__, acc.save_state, acc.end_training

    def accelerator_init(self, *args, **kwargs):
        if not any(name == "main" for name, _ in MARKS):
            mark("main")
        acc_init(self, *args, **kwargs)

    def accelerator_save_state(self, *args, **kwargs):
        mark("checkpoint_begin")
        try:
            return save_state(self, *args, **kwargs)
        finally:
            mark("checkpoint_end")

    def accelerator_end_training(self, *args, **kwargs):
        mark("end_training")
        return end_training(self, *args, **kwargs)

    acc.__init__, acc.save_state, acc.end_training = accelerator_init, accelerator_save_state, accelerator_end_training

    import diffusers
    import diffusers.training_utils

    pipeline_cls = diffusers.DiffusionPipeline
    from_pretrained = pipeline_cls.__dict__["from_pretrained"].__func__

    def pipeline_from_pretrained(cls, *args, **kwargs):
        mark("pipeline_load")
        return from_pretrained(cls, *args, **kwargs)

    pipeline_cls.from_pretrained = classmethod(pipeline_from_pretrained)
    free_memory = diffusers.training_utils.free_memory

    def clocked_free_memory(*args, **kwargs):
        try:
            return free_memory(*args, **kwargs)
        finally:
            mark("free_memory")

    diffusers.training_utils.free_memory = clocked_free_memory


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    marks_path, script = sys.argv[1], os.path.abspath(sys.argv[2])

    def write() -> None:
        with open(marks_path, "w") as f:
            json.dump({"t_start": T_START, "marks": MARKS}, f)

    atexit.register(write)
    _install()
    sys.argv = [script, *sys.argv[3:]]
    sys.path[0] = os.path.dirname(script)  # what `python SCRIPT` puts first (here it was bench/)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
