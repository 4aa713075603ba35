#!/usr/bin/env python
"""imagetune against diffusers' own DreamBooth LoRA example, whole process against whole process, on the offline demo.

    python bench/vs_diffusers.py --script PATH/train_dreambooth_lora.py [--steps 300] [--repeats 3]
                                 [--variants demo,train] [--threads N] [--json FILE] [--work-dir DIR] [--keep-runs]

`--script` is diffusers' `examples/dreambooth/train_dreambooth_lora.py`, run as it is (nothing of it is copied here).
The README's figures used the file at diffusers commit 58eb52c0803ea9af3abec60841c2a093bdf1f951 (it says 0.40.0.dev0;
its `check_min_version` passes with diffusers 0.42.1); from a clone of https://github.com/huggingface/diffusers:

    git show 58eb52c0803ea9af3abec60841c2a093bdf1f951:examples/dreambooth/train_dreambooth_lora.py \
        > /tmp/train_dreambooth_lora.py

**The work** is the offline demo, `presets/demo.yaml`: the 1.8M-parameter SD 1.x-architecture model `demo://tiny-sd`
(trainer/assets/tiny-sd, a diffusers pipeline folder), the 16 captioned 64 px images of `demo://sks-circle`, LoRA
rank 8 alpha 8 on the UNet's to_q/to_k/to_v/to_out.0 and on the text encoder's q/k/v/out_proj (both trained),
batch 4 = 2 per device x accumulation 2 on one CPU process, fp32, AdamW (lr 2e-3, weight decay 1e-2, betas 0.9/0.999,
eps 1e-8), cosine schedule with 20 warm-up steps, gradient clipping 1.0, 300 optimizer steps (`--steps`), seed 0.
Before anything is timed, the bench materializes the demo assets once as plain folders:
`trainer.core.assets.demo_assets(WORK/runs/.demo)` (what `launch.py` does for `demo://`, so imagetune's runs find them
built), and copies the 16 PNGs alone into WORK/diffusers-data/sks-circle (the script's dataset opens every file in its
folder as an image, the .txt captions included).

**Variants** (`--variants`, both by default):

- `demo`: the demo as users run it. imagetune draws samples at steps 0, 100, 200 and 300 (4 images of the concept
  prompt and 4 of a control prompt, 20 DPMSolverMultistep steps, guidance 4, fp32, one pipeline call per image; the
  shapes judge scores them), checkpoints at 100, 200 and 300 (keeps 2), and writes its outputs. The script
  validates every `--validation_epochs` epochs (4 images of the concept prompt, the pipeline's default 50 steps with
  DPMSolverMultistep, guidance 7.5, one call per image, under `torch.amp.autocast("cpu")`, i.e. bf16 on a CPU), and
  after training reloads the pipeline, loads the LoRA file and draws 4 more at 25 steps; it checkpoints every
  `--checkpointing_steps` (accelerate's `save_state`: LoRA weights, optimizer, scheduler, RNG states).
- `train`: both without samples/validation and without intermediate checkpoints, to separate training speed from the
  extras: imagetune with `sample.every=0`, the concept and control prompts emptied, `checkpoint.every=0` (it still
  saves the final checkpoint at the last step, and its outputs); the script without `--validation_prompt` (no
  validation, no final inference; it still reloads the pipeline from disk and loads its LoRA file into it after
  training) and `--checkpointing_steps` beyond the last step (only the final LoRA file).

**The commands**, each a fresh process started by this file, in WORK (default .cache/bench-vs, git-ignored):

- imagetune: exactly what a user runs, from the repository root:
  `python launch.py --preset demo --runs-dir WORK/runs devices=cpu:1` (+ `train.steps=N` when `--steps` is not the
  preset's 300, + the `train` variant's overrides). Its latent cache (WORK/runs/.cache) is deleted before every run,
  so each run encodes its latents as a user's first run does (`--warm-cache` keeps it: a user's later runs).
- diffusers: `python bench/_clocked_script.py MARKS SCRIPT FLAGS`, i.e. the unmodified script run by `runpy` with
  clock reads at a few library calls (bench/_clocked_script.py says which), because it writes no timestamps itself.
  FLAGS: `--pretrained_model_name_or_path trainer/assets/tiny-sd --instance_data_dir WORK/diffusers-data/sks-circle
  --instance_prompt "a photo of a sks circle on a white background" --output_dir WORK/diffusers-runs/RUN --seed 0
  --resolution 64 --center_crop --train_text_encoder --rank 8 --train_batch_size 2 --gradient_accumulation_steps 2
  --max_train_steps 300 --learning_rate 2e-3 --lr_scheduler cosine --lr_warmup_steps 20 --mixed_precision no
  --report_to tensorboard` and, for `demo`, `--checkpointing_steps 100 --checkpoints_total_limit 2
  --validation_prompt "a photo of a sks circle on a white background" --num_validation_images 4
  --validation_epochs 25` (100 optimizer steps / 4 steps per epoch: 16 images, 8 micro-batches of 2, 4 updates;
  validation runs after epochs 0, 25 and 50, i.e. after steps 4, 104 and 204), for `train` `--checkpointing_steps
  N+1`. `--report_to tensorboard` is the script's default; accelerate drops a tracker whose package is missing (a
  warning), and none is installed here, so the script logs to nothing, like imagetune. The rest are the script's
  defaults, which equal imagetune's (AdamW settings, clipping 1.0, LoRA alpha = rank, dropout 0, gaussian init,
  0 dataloader workers, lanczos resize).

**What remains different** (the script has no flag for it):
- Flips: imagetune's demo flips images at random (`data.flip`); the script has no flip augmentation.
- Latents: imagetune VAE-encodes the 16 images once (both flips) into a latent cache and samples from the cached
  distributions; the script runs the VAE encoder on every micro-batch. Text: both run the text encoder every
  micro-batch (it is trained; the script's `--pre_compute_text_embeddings` refuses `--train_text_encoder`).
- Captions: imagetune reads each image's caption ("... on a white/gray/black background"); the script gives every
  image one `--instance_prompt` (the demo's concept prompt, the caption of 6 of the 16 images; the same token count).
- Samples: imagetune 4 rounds x 8 images x 20 steps (guidance 4); the script 3 rounds x 4 images x 50 steps + 4
  final images x 25 steps (guidance 7.5, bf16 autocast), after steps 4, 104, 204 and 300 instead of 0, 100, 200, 300.
  So 640 UNet calls (of batch 2, with guidance) against 700. imagetune also scores its samples (shapes judge).
- Checkpoints: imagetune's hold the LoRA weights, optimizer and schedule state and the data position; the script's
  accelerate's `save_state` (LoRA weights, optimizer, scheduler, RNG states). imagetune writes its outputs in two
  formats (diffusers and kohya); the script one.
- No class images and no prior preservation on either side. One process: imagetune's launcher starts the worker
  (`launch.py` -> `python -m trainer.engine.worker`, with torchrun's variables so accelerate makes a 1-rank group);
  the script is a single `python` process.
- Environment: both get this process's environment plus HF_HUB_OFFLINE=1, CUDA_VISIBLE_DEVICES="" (a CPU plan),
  PYTHONUNBUFFERED=1 (what imagetune gives its worker) and the same OMP_NUM_THREADS (`--threads`, default: what
  `trainer.core.launcher.build_env` would choose, cores / processes). One more for the script, where needed:
  transformers 5.x's `add_adapter` (which the script calls on the text encoder) refuses peft < 0.22 with a version
  check, and PyPI has no peft 0.22 yet; so when the installed peft is older than transformers' MIN_PEFT_VERSION, the
  script's PYTHONPATH starts with WORK/peft-version-shim, a `peft-<min>.dist-info/METADATA` that makes
  `importlib.metadata.version("peft")` answer transformers' minimum. The peft code is the installed one, unchanged
  (imagetune calls the same `peft.inject_adapter_in_model` that transformers' `add_adapter` calls after the check).

**Order**: `--repeats` rounds (default 3); in each, for each variant, the two sides one after the other, imagetune
first in even rounds and diffusers first in odd ones, so a shared machine's drift does not favour one side. Medians
are reported, and the median of the per-round ratios (the two runs of a round are minutes apart).

**What is measured** per run, by this process:
- wall time: `time.perf_counter()` from just before `Popen` to the reaping of the process (`os.wait4`);
- CPU time: user + system of the process and every descendant it reaped (wait4's rusage: launch.py, the demo asset
  check it spawns, the worker; the script's one process);
- peak RSS: wait4's ru_maxrss (the largest single process of the tree), and the sum of the tree's VmRSS sampled
  every 0.5 s (the poll also finds imagetune's worker and its start time, /proc/PID/stat);
- steps/s: 1 / the median interval between consecutive optimizer steps with nothing else between them (imagetune:
  its `progress` events; the script: its "Steps" bar updates), and steps per second of whole-process wall time;
- the split of the wall time into phases: imagetune from its events (`sample`/`eval` after each sampling,
  `checkpoint`, `done`), the worker's start and the end of its setup (the first heartbeat's `stepped`, written once
  before the step-0 samples); the script from its marks. Phases: start (spawn -> imports done: the script's `main`;
  imagetune's launcher until its worker process starts), setup (-> the training loop starts: model loading, LoRA,
  data; for imagetune also the worker's imports and its latent cache), samples (every sampling/validation window,
  the final one included), checkpoints (every one, the final one included), steps (the rest of the training loop),
  outputs (after the last step and its samples/checkpoint until the last in-process mark: imagetune's `done`, the
  script's `end_training`), exit (-> the process is reaped). They add up to the wall time;
- the CPU time of each phase: the process tree's CPU time (/proc/PID/stat of every process seen, the exited ones at
  their last reading) polled every 0.5 s, interpolated at the phase boundaries (the last point is wait4's total);
  CPU-ms per step = the `steps` phase's CPU time / steps. On a shared machine these are much steadier than wall
  time, which mostly measures how much of a core the other tenants left;
- the launcher's demo asset check (a child process of launch.py): from its start (/proc) to the last poll that saw
  it;
- imports alone, before the runs (`--probe-repeats`, 3 each, alternating, fresh processes): spawn until imagetune's
  worker modules are imported, and until the script's own top-level `import` statements (read from --script with
  `ast`) have run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._common import cpu_seconds, fmt, markdown_table, median

PRESET = REPO_ROOT / "presets" / "demo.yaml"
CLOCK = REPO_ROOT / "bench" / "_clocked_script.py"
SIDES = ("imagetune", "diffusers")
PHASES = ("start", "setup", "steps", "samples", "checkpoints", "outputs", "exit")
POLL_S = 0.5
# Overrides that switch the demo's samples and intermediate checkpoints off (the `train` variant).
NO_EXTRAS = ["sample.every=0", "sample.concept.prompt=''", "sample.concept.shows=''", "sample.control.prompt=''",
             "sample.control.shows=''", "checkpoint.every=0"]


# ----------------------------------------------------------------------------------------------------------------
# Set-up (not timed)


def demo_settings() -> dict:
    from trainer.core.config import load_config

    c = load_config(PRESET, ["devices=cpu:1"])
    return {"steps": c.train.steps, "per_device": c.batch.per_device, "total": c.batch.total, "rank": c.lora.rank,
            "alpha": c.lora.alpha, "lr": c.train.lr, "scheduler": c.train.scheduler, "warmup": c.train.warmup_steps,
            "resolution": c.data.resolution, "seed": c.seed, "sample_every": c.sample.every,
            "images_per_prompt": c.sample.images_per_prompt, "checkpoint_every": c.checkpoint.every,
            "checkpoint_keep": c.checkpoint.keep, "concept_prompt": c.sample.concept.prompt,
            "train_text_encoder": c.lora.train_text_encoder, "config": c}


def materialize(work: Path) -> dict:
    """The demo's model and data as plain folders (built once), the images-only copy for the script, and the peft
    version shim if transformers needs it. Returns their paths and how long the demo asset check takes."""
    from trainer.core.assets import DEMO_DIR, demo_assets

    runs = work / "runs"
    assets = demo_assets(runs / DEMO_DIR, ["tiny-sd", "sks-circle"])  # built here if missing
    began = time.perf_counter()
    demo_assets(runs / DEMO_DIR, ["tiny-sd", "sks-circle"])  # what every launch.py run does again: a check
    check_s = time.perf_counter() - began
    images = sorted(p for p in assets["sks-circle"].iterdir() if p.suffix.lower() == ".png")
    data = work / "diffusers-data" / "sks-circle"
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    for p in images:
        shutil.copy2(p, data / p.name)
    return {"model": assets["tiny-sd"], "imagetune_data": assets["sks-circle"], "diffusers_data": data,
            "images": len(images), "asset_check_s": check_s, "shim": peft_shim(work)}


def peft_shim(work: Path) -> dict | None:
    import importlib.metadata

    from packaging.version import Version

    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except ImportError:
        return None
    installed = importlib.metadata.version("peft")
    if Version(installed) >= Version(MIN_PEFT_VERSION):
        return None
    root = work / "peft-version-shim"
    shutil.rmtree(root, ignore_errors=True)
    info = root / f"peft-{MIN_PEFT_VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: peft\nVersion: {MIN_PEFT_VERSION}\n")
    return {"path": str(root), "installed": installed, "reported": MIN_PEFT_VERSION}


def base_env(threads: int | None, config) -> dict:
    from trainer.core.launcher import build_env, plan_for

    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
        env["OMP_NUM_THREADS"] = build_env(plan_for(config), base=env)["OMP_NUM_THREADS"]
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# What each side's training process imports, timed alone in fresh processes (the split of imagetune's `setup` into
# imports and the rest: its worker reports no time between them). imagetune: the modules its worker imports before
# and during setup (as bench/_common.py lists them); the script: its own top-level import statements, read with `ast`
# from --script and executed (no more of it).
WORKER_IMPORTS = ("import trainer.engine.worker as w; w.quiet_library_chatter(); import accelerate, torch; "
                  "import trainer.families.sd.family, trainer.core.events, trainer.engine.loop, trainer.engine.input")
SCRIPT_IMPORTS = ("import ast, sys; tree = ast.parse(open(sys.argv[1]).read()); "
                  "exec(compile(ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], []), "
                  "sys.argv[1], 'exec'))")


def import_probe(script: Path, env: dict, shim: dict | None, repeats: int) -> dict:
    """Seconds from spawn until the imports are done (interpreter start included), alternating, `repeats` each."""
    timer = "import time, sys; t = float(sys.argv[-1]); {body}; print('IMPORTED', time.time() - t)"
    out: dict[str, list[float]] = {s: [] for s in SIDES}
    for i in range(repeats):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            side_env = dict(env)
            if side == "imagetune":
                body, argv = WORKER_IMPORTS, []
                side_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            else:
                body, argv = SCRIPT_IMPORTS, [str(script)]
                if shim:
                    side_env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim["path"], env.get("PYTHONPATH")]))
            cmd = [sys.executable, "-c", timer.format(body=body), *argv, repr(time.time())]
            done = subprocess.run(cmd, env=side_env, capture_output=True, text=True, cwd="/", check=False)
            lines = [l for l in done.stdout.splitlines() if l.startswith("IMPORTED")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"the {side} import probe failed:\n{done.stderr[-2000:]}")
            out[side].append(float(lines[-1].split()[1]))
    return {side: {"median_s": median(v), "all_s": [round(x, 2) for x in v]} for side, v in out.items()}


# ----------------------------------------------------------------------------------------------------------------
# The two commands


def imagetune_command(args, variant: str, settings: dict, work: Path) -> list[str]:
    # The KEY=VALUE overrides together at the end: argparse takes no more of them after an option.
    cmd = [sys.executable, "launch.py", "--preset", "demo", "--runs-dir", str(work / "runs"), "devices=cpu:1"]
    if args.steps != settings["steps"]:
        cmd.append(f"train.steps={args.steps}")
    if variant == "train":
        cmd += NO_EXTRAS
    return cmd


def steps_per_epoch(images: int, settings: dict) -> int:
    accumulation = settings["total"] // settings["per_device"]
    return math.ceil(math.ceil(images / settings["per_device"]) / accumulation)


def diffusers_flags(args, variant: str, settings: dict, paths: dict, out_dir: Path) -> list[str]:
    s = settings
    prompt = s["concept_prompt"]
    flags = [
        "--pretrained_model_name_or_path", str(paths["model"]), "--instance_data_dir", str(paths["diffusers_data"]),
        "--instance_prompt", prompt, "--output_dir", str(out_dir), "--seed", str(s["seed"]),
        "--resolution", str(s["resolution"]), "--center_crop", "--train_text_encoder", "--rank", str(s["rank"]),
        "--train_batch_size", str(s["per_device"]), "--gradient_accumulation_steps", str(s["total"] // s["per_device"]),
        "--max_train_steps", str(args.steps), "--learning_rate", repr(s["lr"]), "--lr_scheduler", s["scheduler"],
        "--lr_warmup_steps", str(s["warmup"]), "--mixed_precision", "no", "--report_to", "tensorboard",
    ]
    if variant == "demo":
        epochs = max(1, round(s["sample_every"] / steps_per_epoch(paths["images"], s)))
        flags += ["--checkpointing_steps", str(s["checkpoint_every"]), "--checkpoints_total_limit",
                  str(s["checkpoint_keep"]), "--validation_prompt", prompt,
                  "--num_validation_images", str(s["images_per_prompt"]), "--validation_epochs", str(epochs)]
    else:
        flags += ["--checkpointing_steps", str(args.steps + 1)]
    return flags


# ----------------------------------------------------------------------------------------------------------------
# Running one process and watching it


def _boot_epoch() -> float:
    return time.time() - float(Path("/proc/uptime").read_text().split()[0])


def _start_time(pid: int, boot: float) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _tree(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:
        from bench._common import descendants

        return descendants(pid)
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def run_process(cmd: list[str], env: dict, log_path: Path, runs_dir: Path | None = None) -> dict:
    """Start `cmd` in the repository root, poll it every POLL_S s until it is reaped. With `runs_dir` (imagetune),
    also find the new run folder, the worker process and the first heartbeat."""
    boot = _boot_epoch()
    before = {p.name for p in runs_dir.iterdir()} if runs_dir else set()
    watch: dict = {"processes": {}, "tree_rss_peak_mb": 0.0}
    last_cpu: dict[int, float] = {}  # every process of the tree seen so far: its CPU seconds at the last poll
    cpu_curve: list[tuple[float, float]] = []  # (time, CPU seconds of the whole tree so far), one point per poll
    with open(log_path, "wb") as log:
        t_spawn, p_spawn = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                p_exit, t_exit = time.perf_counter(), time.time()
                break
            pids = [proc.pid, *_tree(proc.pid)]
            for p in pids:
                used = cpu_seconds(p)
                if used is not None:
                    last_cpu[p] = used
            cpu_curve.append((time.time(), sum(last_cpu.values())))
            watch["tree_rss_peak_mb"] = max(watch["tree_rss_peak_mb"], sum(_rss_mb(p) for p in pids))
            for p in pids[1:]:
                if p not in watch["processes"]:
                    try:
                        name = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                    except OSError:
                        continue
                    watch["processes"][p] = {"cmd": name, "start": _start_time(p, boot)}
                watch["processes"][p]["last_seen"] = time.time()
            if runs_dir and "run_dir" not in watch:
                new = [p for p in runs_dir.iterdir() if p.name not in before and not p.name.startswith(".")]
                if new:
                    watch["run_dir"] = str(new[0])
            if "run_dir" in watch and "setup_end" not in watch:
                try:
                    beat = json.loads((Path(watch["run_dir"]) / "heartbeats" / "rank-0.json").read_text())
                    if beat.get("step") == 0:
                        watch["setup_end"] = beat["stepped"]
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(POLL_S)
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu_curve.append((t_exit, usage.ru_utime + usage.ru_stime))  # exact at the end (wait4)
    if runs_dir and "run_dir" not in watch:
        new = [p for p in runs_dir.iterdir() if p.name not in before and not p.name.startswith(".")]
        watch["run_dir"] = str(new[0]) if new else None
    return {"cmd": cmd, "returncode": proc.returncode, "t_spawn": t_spawn, "t_exit": t_exit,
            "wall_s": p_exit - p_spawn, "cpu_s": usage.ru_utime + usage.ru_stime, "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, "max_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "tree_rss_peak_mb": round(watch["tree_rss_peak_mb"], 1),
            "processes": list(watch["processes"].values()), "run_dir": watch.get("run_dir"),
            "setup_end": watch.get("setup_end"), "cpu_curve": [(round(t, 3), round(c, 2)) for t, c in cpu_curve]}


def _failed(side: str, r: dict, log_path: Path) -> SystemExit:
    tail = log_path.read_text(errors="replace")[-4000:]
    return SystemExit(f"the {side} run failed (exit {r['returncode']}): {' '.join(r['cmd'])}\n{tail}")


# ----------------------------------------------------------------------------------------------------------------
# Timelines -> phases


def _windows_total(windows: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in windows)


def _gaps(lo: float, hi: float, windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of [lo, hi] outside every window."""
    out, at = [], lo
    for a, b in sorted(windows):
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def _step_rate(step_ends: list[float], windows: list[tuple[float, float]]) -> float | None:
    """Median interval between consecutive step ends with no sample/checkpoint window between them."""
    clean = [b - a for a, b in itertools.pairwise(step_ends) if _windows_total(windows, a, b) == 0]
    return statistics.median(clean) if clean else None


def _cpu_at(curve: list[tuple[float, float]], t: float) -> float:
    """The tree's CPU seconds at time t, linear between the polls."""
    if t <= curve[0][0]:
        return curve[0][1] * max(0.0, t) / curve[0][0] if curve[0][0] > 0 else 0.0
    for (t0, c0), (t1, c1) in itertools.pairwise(curve):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
    return curve[-1][1]


def _phase_totals(r: dict, intervals: list[tuple[str, float, float]]) -> tuple[dict, dict]:
    """Wall and CPU seconds per phase; the intervals partition spawn .. exit."""
    curve = [(0.0, 0.0)] + [(t - r["t_spawn"], c) for t, c in r["cpu_curve"]]
    wall = {p: 0.0 for p in PHASES}
    cpu = {p: 0.0 for p in PHASES}
    for name, a, b in intervals:
        if b > a:
            wall[name] += b - a
            cpu[name] += _cpu_at(curve, b - r["t_spawn"]) - _cpu_at(curve, a - r["t_spawn"])
    return wall, cpu


def imagetune_phases(r: dict) -> dict:
    run_dir = Path(r["run_dir"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    final = [e for e in events if e["type"] in ("done", "stopped", "failed")]
    if not final or final[-1]["type"] != "done":
        raise SystemExit(f"the imagetune run did not end with `done`: {final[-1:] or 'no final event'}")
    progress = {e["step"]: e["time"] for e in events if e["type"] == "progress"}
    steps = sorted(progress)
    step_ends = [progress[s] for s in steps]
    worker = [p for p in r["processes"] if "trainer.engine.worker" in p["cmd"] and p["start"]]
    worker_start = worker[0]["start"] if worker else r["t_spawn"]
    setup_end = r.get("setup_end")
    if setup_end is None:
        raise SystemExit(f"the poll missed imagetune's first heartbeat (the end of its setup) in {run_dir}")
    # Sampling windows: from the step's end (step 0: the end of setup) to its last sample/eval event.
    by_step: dict[int, float] = {}
    for e in events:
        if e["type"] in ("sample", "eval"):
            by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["time"])
    samples = [(progress[k] if k else setup_end, end) for k, end in sorted(by_step.items()) if not k or k in progress]
    checkpoints = []
    for e in events:
        if e["type"] == "checkpoint":
            start = max([progress.get(e["step"], 0.0)] + [b for a, b in samples if a == progress.get(e["step"])])
            checkpoints.append((start, e["time"]))
    done = final[-1]["time"]
    training_start = by_step.get(0, setup_end)
    last_step = step_ends[-1]
    extras = samples + checkpoints
    tail_start = max([last_step] + [b for a, b in extras if a >= last_step])
    intervals = [("start", r["t_spawn"], worker_start), ("setup", worker_start, setup_end)]
    intervals += [("samples", a, b) for a, b in samples] + [("checkpoints", a, b) for a, b in checkpoints]
    intervals += [("steps", a, b) for a, b in _gaps(training_start, last_step, extras)]
    intervals += [("outputs", tail_start, done), ("exit", done, r["t_exit"])]
    wall, cpu = _phase_totals(r, intervals)
    # The launcher's child that checks the demo assets (trainer.core.assets.demo_assets): seen by the 0.5 s poll.
    check = [p for p in r["processes"] if "import importlib, json" in p["cmd"] and p["start"]]
    return {"phases": wall, "phases_cpu": cpu, "steps_done": len(steps), "step_s": _step_rate(step_ends, extras),
            "asset_check_seen_s": (check[0]["last_seen"] - check[0]["start"]) if check else None,
            "sample_rounds": len(samples), "checkpoint_count": len(checkpoints),
            "marks": {"worker_start": worker_start, "setup_end": setup_end, "training_start": training_start,
                      "last_step": last_step, "done": done},
            "samples_windows": samples, "checkpoint_windows": checkpoints}


def diffusers_phases(r: dict, marks_path: Path) -> dict:
    data = json.loads(marks_path.read_text())
    marks = data["marks"]
    first: dict[str, float] = {}
    for name, t in marks:
        first.setdefault(name, t)
    step_ends = [t for name, t in marks if name == "step"]
    checkpoints, validations, open_ckpt, open_val = [], [], None, None
    for name, t in marks:
        if name == "checkpoint_begin":
            open_ckpt = t
        elif name == "checkpoint_end" and open_ckpt is not None:
            checkpoints.append((open_ckpt, t))
            open_ckpt = None
        elif name == "pipeline_load":
            open_val = t
        elif name == "free_memory" and open_val is not None:
            validations.append((open_val, t))
            open_val = None
    last_step = step_ends[-1]
    extras = validations + checkpoints
    end = first.get("end_training", last_step)
    intervals = [("start", r["t_spawn"], first["main"]), ("setup", first["main"], first["loop_start"])]
    intervals += [("samples", a, b) for a, b in validations] + [("checkpoints", a, b) for a, b in checkpoints]
    intervals += [("steps", a, b) for a, b in _gaps(first["loop_start"], last_step, extras)]
    intervals += [("outputs", a, b) for a, b in _gaps(last_step, end, extras)]
    intervals.append(("exit", end, r["t_exit"]))
    wall, cpu = _phase_totals(r, intervals)
    return {"phases": wall, "phases_cpu": cpu, "steps_done": len(step_ends), "step_s": _step_rate(step_ends, extras),
            "sample_rounds": len(validations), "checkpoint_count": len(checkpoints),
            "marks": {"t_start": data["t_start"], **first, "last_step": last_step},
            "samples_windows": validations, "checkpoint_windows": checkpoints}


# ----------------------------------------------------------------------------------------------------------------
# Driver


def run_side(side: str, variant: str, index: int, args, settings: dict, paths: dict, env: dict, work: Path) -> dict:
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"{variant}-{index}-{side}.log"
    if side == "imagetune":
        if not args.warm_cache:
            shutil.rmtree(work / "runs" / ".cache", ignore_errors=True)
        r = run_process(imagetune_command(args, variant, settings, work), env, log_path, runs_dir=work / "runs")
        if r["returncode"] != 0:
            raise _failed(side, r, log_path)
        r.update(imagetune_phases(r))
        if not args.keep_runs and r["run_dir"]:
            shutil.rmtree(r["run_dir"], ignore_errors=True)
    else:
        out_dir = work / "diffusers-runs" / f"{variant}-{index}"
        shutil.rmtree(out_dir, ignore_errors=True)
        marks = logs / f"{variant}-{index}-diffusers-marks.json"
        marks.unlink(missing_ok=True)
        side_env = dict(env, PYTHONUNBUFFERED="1")
        if paths["shim"]:
            side_env["PYTHONPATH"] = os.pathsep.join(filter(None, [paths["shim"]["path"], env.get("PYTHONPATH")]))
        cmd = [sys.executable, str(CLOCK), str(marks), str(args.script)] + diffusers_flags(args, variant, settings,
                                                                                          paths, out_dir)
        r = run_process(cmd, side_env, log_path)
        if r["returncode"] != 0:
            raise _failed(side, r, log_path)
        r.update(diffusers_phases(r, marks))
        r["output_files"] = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file())
        if not args.keep_runs:
            shutil.rmtree(out_dir, ignore_errors=True)
    if r["steps_done"] != args.steps:
        raise SystemExit(f"the {side} run made {r['steps_done']} optimizer steps, not {args.steps} (log: {log_path})")
    r["steps_per_s"] = 1 / r["step_s"] if r["step_s"] else None
    r["wall_steps_per_s"] = args.steps / r["wall_s"]
    r["load_average"] = os.getloadavg()
    return r


def _per(runs: list[dict], phase: str, count: str, key: str = "phases") -> float | None:
    return median([r[key][phase] / r[count] for r in runs if r[count]])


def summarise(runs: list[dict], steps: int) -> dict:
    step_s = median([r["step_s"] for r in runs])
    return {
        "wall_s": median([r["wall_s"] for r in runs]), "cpu_s": median([r["cpu_s"] for r in runs]),
        "max_rss_mb": median([r["max_rss_mb"] for r in runs]),
        "tree_rss_peak_mb": median([r["tree_rss_peak_mb"] for r in runs]),
        "step_ms": 1000 * step_s if step_s else None,
        "cpu_ms_per_step": 1000 * median([r["phases_cpu"]["steps"] / steps for r in runs]),
        "steps_per_s": median([r["steps_per_s"] for r in runs]),
        "wall_steps_per_s": median([r["wall_steps_per_s"] for r in runs]),
        "phases": {p: median([r["phases"][p] for r in runs]) for p in PHASES},
        "phases_cpu": {p: median([r["phases_cpu"][p] for r in runs]) for p in PHASES},
        "wall_s_all": [round(r["wall_s"], 1) for r in runs], "cpu_s_all": [round(r["cpu_s"], 1) for r in runs],
        "sample_rounds": runs[0]["sample_rounds"], "checkpoint_count": runs[0]["checkpoint_count"],
        "asset_check_seen_s": median([r.get("asset_check_seen_s") for r in runs]),
        "sample_s_each": _per(runs, "samples", "sample_rounds"),
        "sample_cpu_each": _per(runs, "samples", "sample_rounds", "phases_cpu"),
        "checkpoint_s_each": _per(runs, "checkpoints", "checkpoint_count"),
        "checkpoint_cpu_each": _per(runs, "checkpoints", "checkpoint_count", "phases_cpu"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", required=True, type=Path,
                   help="diffusers' examples/dreambooth/train_dreambooth_lora.py (see above for the commit)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo preset's, 300)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every variant on both sides; medians reported")
    p.add_argument("--variants", default="demo,train", help="comma-separated: demo (samples + checkpoints), train")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both (default: what imagetune's launcher "
                   "chooses, cores / processes)")
    p.add_argument("--work-dir", default=str(REPO_ROOT / ".cache" / "bench-vs"),
                   help="assets, run folders and logs (default .cache/bench-vs, git-ignored)")
    p.add_argument("--warm-cache", action="store_true", help="keep imagetune's latent cache between its runs")
    p.add_argument("--keep-runs", action="store_true", help="keep both sides' run/output folders")
    p.add_argument("--probe-repeats", type=int, default=3,
                   help="times each side's imports alone are measured before the runs (0: not at all)")
    p.add_argument("--json", help="also write every run's figures here")
    args = p.parse_args(argv)
    args.script = args.script.resolve()
    if not args.script.is_file():
        p.error(f"--script {args.script} is not a file")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in ("demo", "train") for v in variants):
        p.error("--variants takes demo and/or train")

    settings = demo_settings()
    args.steps = args.steps or settings["steps"]
    work = Path(args.work_dir).resolve()
    (work / "runs").mkdir(parents=True, exist_ok=True)
    paths = materialize(work)
    env = base_env(args.threads, settings["config"])
    import torch

    print(f"demo: {paths['images']} images, {args.steps} steps; OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; "
          f"{args.repeats} repeats of {', '.join(variants)}; script {args.script}"
          + (f"; peft {paths['shim']['installed']} reported as {paths['shim']['reported']} to the script"
             if paths["shim"] else ""), flush=True)
    probe = import_probe(args.script, env, paths["shim"], args.probe_repeats) if args.probe_repeats else None
    if probe:
        print("imports alone (spawn -> imports done, fresh processes): "
              + ", ".join(f"{side} {probe[side]['median_s']:.1f} s {probe[side]['all_s']}" for side in SIDES),
              flush=True)
    runs: dict[str, dict[str, list[dict]]] = {v: {s: [] for s in SIDES} for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    cpu_ratios: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.repeats):
        for variant in variants:
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            pair = {}
            for side in order:
                r = run_side(side, variant, i, args, settings, paths, env, work)
                pair[side] = r
                runs[variant][side].append(r)
                ph = r["phases"]
                print(f"  round {i + 1} {variant:5s} {side:9s}: wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  "
                      f"peak RSS {r['max_rss_mb']:5.0f} MB  {fmt(r['step_s'] and 1000 * r['step_s'], 0)} ms/step; "
                      "phases wall/CPU s: "
                      + "  ".join(f"{k} {fmt(v, 1)}/{fmt(r['phases_cpu'][k], 1)}" for k, v in ph.items())
                      + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
            ratios[variant].append(pair["diffusers"]["wall_s"] / pair["imagetune"]["wall_s"])
            cpu_ratios[variant].append(pair["diffusers"]["cpu_s"] / pair["imagetune"]["cpu_s"])

    summary = {v: {s: summarise(runs[v][s], args.steps) for s in SIDES} for v in variants}
    headers = ["variant", "side", "wall s", "CPU s (process tree)", "peak RSS MB (largest process)",
               "ms per step (wall)", "CPU-ms per step", "steps/s (training)", "steps per wall-clock s"]
    rows = []
    for v in variants:
        for s in SIDES:
            x = summary[v][s]
            rows.append([v, s, fmt(x["wall_s"], 1), fmt(x["cpu_s"], 1), fmt(x["max_rss_mb"], 0), fmt(x["step_ms"], 0),
                         fmt(x["cpu_ms_per_step"], 0), fmt(x["steps_per_s"], 2), fmt(x["wall_steps_per_s"], 2)])
    table = markdown_table(headers, rows)
    print()
    print(f"medians of {args.repeats} rounds, {args.steps} steps:")
    print(table)
    verdicts = {}
    for v in variants:
        it, df = summary[v]["imagetune"], summary[v]["diffusers"]
        verdicts[v] = {"wall_ratio_of_medians": df["wall_s"] / it["wall_s"], "wall_ratio_median_of_rounds":
                       median(ratios[v]), "wall_ratios": [round(x, 3) for x in ratios[v]],
                       "cpu_ratio_of_medians": df["cpu_s"] / it["cpu_s"],
                       "cpu_ratio_median_of_rounds": median(cpu_ratios[v]),
                       "cpu_ratios": [round(x, 3) for x in cpu_ratios[v]]}
        print(f"{v}: imagetune is {verdicts[v]['wall_ratio_of_medians']:.2f}x faster in wall time (diffusers / "
              f"imagetune, medians; per round {verdicts[v]['wall_ratios']}, "
              f"median {verdicts[v]['wall_ratio_median_of_rounds']:.2f}); in CPU time "
              f"{verdicts[v]['cpu_ratio_of_medians']:.2f}x (per round {verdicts[v]['cpu_ratios']})")
    phase_tables = {}
    for v in variants:
        it_s, df_s = summary[v]["imagetune"], summary[v]["diffusers"]

        def row(name, a, b, ca, cb, digits=1):
            diff = cb - ca if ca is not None and cb is not None else None
            return [name, fmt(a, digits), fmt(b, digits), fmt(ca, digits), fmt(cb, digits), fmt(diff, digits)]

        extra = {
            "start": [["- of which the launcher's demo asset check (its child process, seen by the 0.5 s poll)",
                       fmt(it_s["asset_check_seen_s"], 1), "-", "", "", ""]],
            "setup": [[("- imports alone, for comparison (separate processes, spawn -> imported; diffusers' are "
                        "in its `start`)"), fmt(probe["imagetune"]["median_s"], 1),
                       fmt(probe["diffusers"]["median_s"], 1), "", "", ""]] if probe else [],
            "samples": [row("- per sampling round / validation", it_s["sample_s_each"], df_s["sample_s_each"],
                            it_s["sample_cpu_each"], df_s["sample_cpu_each"])],
            "checkpoints": [row("- per checkpoint", it_s["checkpoint_s_each"], df_s["checkpoint_s_each"],
                                it_s["checkpoint_cpu_each"], df_s["checkpoint_cpu_each"], 2)],
        }
        rows = []
        for name in PHASES:
            rows.append(row(name, it_s["phases"][name], df_s["phases"][name], it_s["phases_cpu"][name],
                            df_s["phases_cpu"][name]))
            rows += extra.get(name, [])
        rows.append(row("whole process", it_s["wall_s"], df_s["wall_s"], it_s["cpu_s"], df_s["cpu_s"]))
        phase_tables[v] = markdown_table(["phase (medians)", "imagetune wall s", "diffusers wall s",
                                          "imagetune CPU s", "diffusers CPU s", "diffusers - imagetune, CPU s"],
                                         rows)
        print()
        print(f"{v}: where the time goes")
        print(phase_tables[v])
    result = {"steps": args.steps, "repeats": args.repeats, "variants": variants, "script": str(args.script),
              "omp_num_threads": env["OMP_NUM_THREADS"], "peft_shim": paths["shim"],
              "asset_check_s": paths["asset_check_s"], "import_probe": probe, "summary": summary,
              "verdicts": verdicts, "table": table,
              "phase_tables": phase_tables, "runs": runs,
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]}}
    try:
        import accelerate
        import diffusers
        import peft
        import transformers

        result["machine"].update(diffusers=diffusers.__version__, transformers=transformers.__version__,
                                 accelerate=accelerate.__version__, peft=peft.__version__)
    except ImportError:
        pass
    if args.json:
        for by_side in runs.values():  # the 0.5 s CPU polls stay out (bulky); phases_cpu holds what they gave
            for side_runs in by_side.values():
                for r in side_runs:
                    r.pop("cpu_curve", None)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
