#!/usr/bin/env python
"""How much does the engine cost over a plain hand-written accelerate loop doing the same training?

    python bench/engine_overhead.py [--steps 60] [--warmup 10] [--devices cpu:1] [--repeats 3] [--json FILE]
    python bench/engine_overhead.py --compile [...]   # the engine with and without train.compile instead

All loops train the offline demo model (`demo://tiny-sd`, a ~1M-parameter SD 1.x UNet) on the demo dataset
with the settings of presets/demo.yaml (LoRA rank 8 on to_q/k/v/out.0, batch 4 = per_device 2 x accumulation 2
on one process, AdamW lr 1e-3, cosine with warmup, gradient clipping 1.0, cached VAE latents with flips,
fp32 on CPU / bf16 autocast on GPU), for warm-up + N optimizer steps, with no samples and no checkpoints
during training. Each loop runs in fresh processes, the order rotating every repeat:

- engine: `trainer.core.launcher.prepare_run` + `start_run` -> torchrun -> the worker (`trainer.engine.worker.main`,
  run through bench/_common.py, which only adds clock reads at each `progress` event and a report of the
  worker's peak memory when it exits).
  Throughput comes from the `progress` events' timestamps (steps warmup .. warmup+N).
- plain: this file with `--role plain`: diffusers components, `unet.add_adapter(peft.LoraConfig(...))`,
  latents encoded once, one torch generator for all noise, `accelerator.accumulate`, AdamW. Nothing else.
  Started by plain `python`.
- plain+ddp (one process only): the same plain loop started by torchrun, where accelerate (like in the engine)
  creates a 1-rank process group and wraps the model in DDP.

Peak memory: on CPU the training process's peak RSS (its own VmRSS sampled every 50 ms and its VmHWM, the
larger; the launcher also polls the worker's VmHWM as a cross-check); on CUDA `torch.cuda.max_memory_allocated()`
in the training process. CPU time per step (all threads of the training process) is reported next to wall-clock
time: on a shared machine it is the steadier of the two. Startup (spawn of the launching process to the end of the first optimizer step) is reported on its
own, split into launcher / torchrun / imports / setup: it is mostly imports.

`--compile` runs the engine twice per repeat instead, without and with `train.compile` (its UNet's transformer
blocks compiled by torch.compile; no plain loops), and reports the compile time (the seconds its `warning` events
give, all in step 1: no samples are drawn) and the change in step time and CPU time per step.

`--breakdown` (on by default) also times, in this process, the per-sample and per-step pieces of work the engine
does that the plain loop does not, to explain the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._common import (  # noqa: E402
    cpu_seconds, descendants, fmt, markdown_table, median, memory_report, start_rss_sampler, usage_mark, vm_hwm_mb,
)

PRESET = REPO_ROOT / "presets" / "demo.yaml"
WORKER = "bench._common"  # trainer.engine.worker.main + a peak-memory record


# ----------------------------------------------------------------------------------------------------------------
# Configuration shared by all loops


def engine_config(args, assets: dict[str, Path]):
    from trainer.core.config import load_config

    overrides = [
        f"name={args.name}", f"devices={args.devices}", f"train.steps={args.warmup + args.steps}",
        "sample.every=0", "sample.prompts=[]", "checkpoint.every=0",
        f"model.path={assets['tiny-sd']}", f"data.path={assets['demo-data']}",
    ]
    return load_config(PRESET, overrides + list(args.override))


def plain_settings(config, plan) -> dict:
    """Everything the plain loop needs to do the engine's work, as JSON."""
    t = config.train
    return {
        "model": config.model.path, "data": config.data.path, "resolution": config.data.resolution,
        "flip": config.data.flip, "caption_extension": config.data.caption_extension,
        "device": plan.device, "processes": plan.world_size, "per_device": plan.per_device,
        "accumulation": plan.accumulation, "total": plan.total, "precision": plan.precision,
        "rank": config.lora.rank, "alpha": config.lora.alpha, "dropout": config.lora.dropout,
        "targets": list(config.lora.unet_targets), "lr": t.lr, "betas": list(t.betas), "eps": t.eps,
        "weight_decay": t.decay(), "scheduler": t.scheduler, "warmup_steps": t.warmup_steps,
        "max_grad_norm": t.clip_norm(), "steps": t.steps, "seed": config.seed,
        "gradient_checkpointing": t.gradient_checkpointing, "method": config.method,
    }


def rate(times: list[float], warmup: int, total: int) -> tuple[float, float]:
    """(samples/s, ms per optimizer step) between the end of step `warmup` and the end of the last step.
    times[i] is the wall-clock end of optimizer step i+1."""
    first, last = times[warmup - 1], times[-1]
    steps = len(times) - warmup
    seconds = last - first
    return total * steps / seconds, 1000 * seconds / steps


# ----------------------------------------------------------------------------------------------------------------
# Engine side (role "engine": a fresh process that does what launch.py does)


def engine_role(args) -> dict:
    t_spawn = float(args.t_spawn)
    from trainer.core.events import read_events
    from trainer.core.launcher import prepare_run, single_process, start_run

    assets = json.loads(args.assets)
    config = engine_config(args, {k: Path(v) for k, v in assets.items()})
    run_dir, plan = prepare_run(config, args.runs_dir)
    proc = start_run(run_dir, plan, config, worker_module=WORKER)
    t_started = time.time()
    hwm: dict[int, float] = {}
    names: dict[int, str] = {}
    torchrun_cpu: list[tuple[float, float]] = []  # (wall time, torchrun's own CPU seconds)
    report = run_dir / "bench-memory-rank0.json"  # written when main() returns, before interpreter teardown
    while proc.poll() is None:
        used = cpu_seconds(proc.pid)
        if used is not None:
            torchrun_cpu.append((time.time(), used))
        for pid in [] if report.exists() else descendants(proc.pid):
            value = vm_hwm_mb(pid)
            if value is not None:
                hwm[pid] = max(hwm.get(pid, 0.0), value)
                if pid not in names:
                    try:
                        names[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                    except OSError:
                        names[pid] = "?"
        time.sleep(0.2)  # a cross-check only (the worker samples its own RSS): keep the poll cheap
    workers = [pid for pid in hwm if WORKER in names.get(pid, "")]
    final = proc.wait()
    t_exit = time.time()
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # torchrun + the worker it reaped
    events = read_events(run_dir)
    progress = [e for e in events if e["type"] == "progress"]
    result = {"final": final["type"], "run_dir": str(run_dir), "plan": plan.line(),
              # train.compile: "... compiled the N blocks (...) for input ... in 12.3 s (by step 1; ...)"
              "compile_s": sum(float(re.search(r" in ([0-9.]+) s \(by step", e["message"]).group(1)) for e in events
                               if e["type"] == "warning" and e["message"].startswith("train.compile: compiled"))}
    if final["type"] != "done" or len(progress) != plan.steps:
        log = (run_dir / "train.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the engine run did not finish ({final}):\n{log}")
    memory = json.loads(report.read_text())
    times = [e["time"] for e in progress]
    result.update(
        times=times, cpu_times=memory.get("cpu_marks"), usage=memory.get("usage_marks"), reported_samples_per_s=progress[-1]["samples_per_s"], startup_s=times[0] - t_spawn,
        launcher_s=t_started - t_spawn, worker_start_s=memory.get("t_start", t_started) - t_started,
        worker_imports_s=memory.get("t_imported", t_started) - memory.get("t_start", t_started),
        worker_setup_s=times[0] - memory.get("t_imported", t_started), worker_rss_mb=memory["max_rss_mb"],
        cuda_peak_mb=memory["cuda_max_allocated_mb"],
        polled_hwm_mb=max(hwm[pid] for pid in workers) if workers else None,
        polled_processes={f"{pid} {names.get(pid, '?')[:80]}": hwm[pid] for pid in hwm},
        total=plan.total, end_s=t_exit - times[-1],
        # torchrun's own CPU (agent monitor loop, --tee log tailing) while the timed steps ran.
        # (a one-process run has no torchrun: its process is the worker itself, so there is nothing to report)
        torchrun_cpu_share=None if single_process(plan) else _share(
            [c for c in torchrun_cpu if times[warmup_index(args)] <= c[0] <= times[-1]]),
        torchrun_cpu_total_s=children.ru_utime + children.ru_stime - memory.get("cpu_total_s", 0.0),
    )
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def warmup_index(args) -> int:
    return args.warmup - 1


def _share(samples: list[tuple[float, float]]) -> float | None:
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return None
    return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])


# ----------------------------------------------------------------------------------------------------------------
# Plain side (role "plain": a hand-written accelerate loop, fresh process(es))


def plain_role(args) -> dict | None:
    t_spawn = float(args.t_spawn)
    start_rss_sampler()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from peft import LoraConfig
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    t_imports = time.time()
    s = json.loads(args.settings)
    acc = Accelerator(cpu=s["device"] == "cpu", gradient_accumulation_steps=s["accumulation"])
    device = acc.device
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s["precision"])
    frozen = low if (low is not None and s["method"] == "lora") else torch.float32

    model = s["model"]
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae")
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
    noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
    vae.to(device, dtype=torch.float32 if s["precision"] == "fp16" else frozen)
    unet.to(device, dtype=frozen)
    text_encoder.to(device, dtype=frozen)
    torch.manual_seed(s["seed"])
    if s["method"] == "lora":
        unet.add_adapter(LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=s["dropout"],
                                    init_lora_weights="gaussian", target_modules=s["targets"]))
    else:
        unet.requires_grad_(True)
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if s["gradient_checkpointing"]:
        unet.enable_gradient_checkpointing()
    unet.train()

    # Data: every image encoded once (and its mirror image when flipping), captions tokenized once.
    files = sorted(p for p in Path(s["data"]).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    res = s["resolution"]

    def pixels(path: Path) -> torch.Tensor:
        img = Image.open(path).convert("RGB")
        scale = res / min(img.size)
        img = img.resize((max(res, round(img.width * scale)), max(res, round(img.height * scale))), Image.LANCZOS)
        left, top = (img.width - res) // 2, (img.height - res) // 2
        img = img.crop((left, top, left + res, top + res))
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 127.5 - 1

    batch = torch.stack([pixels(f) for f in files]).to(device, vae.dtype)
    with torch.no_grad():
        dists = [vae.encode(batch).latent_dist]
        if s["flip"]:
            dists.append(vae.encode(batch.flip(-1)).latent_dist)
    means = torch.stack([d.mean.float() for d in dists])  # (orientations, N, 4, h, w)
    stds = torch.stack([d.std.float() for d in dists])
    captions = [f.with_suffix(s["caption_extension"]).read_text().strip() for f in files]
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                    return_tensors="pt").input_ids.to(device)
    factor = vae.config.scaling_factor
    n = len(files)

    optimizer = torch.optim.AdamW(params, lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"],
                                  weight_decay=s["weight_decay"])
    lr_scheduler = get_scheduler(s["scheduler"], optimizer, num_warmup_steps=min(s["warmup_steps"], s["steps"]),
                                 num_training_steps=s["steps"])
    unet = acc.prepare(unet)
    gen = torch.Generator(device).manual_seed(s["seed"] * 1000 + acc.process_index)
    autocast = torch.autocast(device.type, dtype=low) if low is not None else torch.autocast(device.type, enabled=False)
    per_device, orientations = s["per_device"], means.shape[0]
    t_setup = time.time()

    times, cpu_times, usage = [], [], []
    for step in range(s["steps"]):
        for _ in range(s["accumulation"]):
            idx = torch.randint(0, n, (per_device,), device=device, generator=gen)
            side = torch.randint(0, orientations, (per_device,), device=device, generator=gen)
            with acc.accumulate(unet):
                with autocast:
                    eps = torch.randn((per_device, *means.shape[2:]), device=device, generator=gen)
                    latents = (means[side, idx] + stds[side, idx] * eps) * factor
                    noise = torch.randn(latents.shape, device=device, generator=gen)
                    t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (per_device,), device=device,
                                      generator=gen)
                    noisy = noise_scheduler.add_noise(latents, noise, t)
                    with torch.no_grad():
                        hidden = text_encoder(ids[idx], return_dict=False)[0]
                    pred = unet(noisy.to(frozen), t, hidden, return_dict=False)[0]
                    loss = F.mse_loss(pred.float(), noise.float())
                acc.backward(loss)
                if acc.sync_gradients:
                    if s["max_grad_norm"]:
                        acc.clip_grad_norm_(params, s["max_grad_norm"])
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda" and (step + 1 in (1, args.warmup) or step + 1 == s["steps"]):
            torch.cuda.synchronize()  # only where a time is read: no per-step host sync otherwise
        times.append(time.time())
        cpu_times.append(time.process_time())
        usage.append(usage_mark())
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return None
    mem = memory_report()
    return {
        "times": times, "cpu_times": cpu_times, "usage": usage, "startup_s": times[0] - t_spawn, "imports_s": t_imports - t_spawn,
        "setup_s": t_setup - t_imports, "first_step_s": times[0] - t_setup, "worker_rss_mb": mem["max_rss_mb"], "cuda_peak_mb": mem["cuda_max_allocated_mb"],
        "total": s["total"],
    }


# ----------------------------------------------------------------------------------------------------------------
# Per-piece timings of what the engine does per sample / per step beyond the plain loop


def breakdown(config, plan, warmup_calls: int = 200, calls: int = 2000) -> list[dict]:
    import torch
    from trainer.families.components.captioned import sample_rng, torch_generator
    from trainer.core.data.stream import BatchStream, position_seed
    from trainer.core.events import EventLog, ProgressEvent
    from trainer.families.components import noise as diffusion
    from trainer.engine.loop import Throughput, _reduce_step
    from trainer.core.stopping import StopRequest

    tmp = Path(tempfile.mkdtemp(prefix="bench-breakdown-"))
    stream = BatchStream(16, total=plan.total, per_device=plan.per_device, world_size=plan.world_size, seed=0)
    log, stop, thr = EventLog(tmp), StopRequest(tmp), Throughput()
    shape = (4, 16, 16)
    losses = [torch.tensor(0.5)] * plan.accumulation
    seed = config.seed

    counter = iter(range(10**9))

    def per_sample_draws():
        # What trainer.families.components.unet_training.ddpm_loss does per sample before the batched maths: the stream
        # position -> item, the flip coin, a generator and its three draws.
        pos = next(counter)
        epoch, idx = stream.item(pos)
        sample_rng(seed, epoch, idx).random()
        gen = torch_generator(position_seed(seed, pos, 0))
        diffusion.draw(gen, shape, num_timesteps=1000, noise_offset=0.0)

    pieces = [
        ("position_seed (SeedSequence)", "sample", lambda: position_seed(seed, 12345, 0)),
        ("torch_generator (SeedSequence + Generator)", "sample", lambda: torch_generator(987654321)),
        ("sample_rng (flip coin: SeedSequence + Random)", "sample", lambda: sample_rng(seed, 3, 7).random()),
        ("diffusion.draw (3 draws, 4x16x16)", "sample",
         lambda: diffusion.draw(torch.Generator().manual_seed(1), shape, num_timesteps=1000, noise_offset=0.0)),
        ("all per-sample draws together", "sample", per_sample_draws),
        ("torch.manual_seed(position_seed(...)) per step", "step",
         lambda: torch.manual_seed(position_seed(seed, 5, 1000))),
        ("_reduce_step (stack, isfinite, .item() x2, all-reduce if DDP)", "step",
         lambda: _reduce_step(losses, False, torch.device("cpu"))),
        ("StopRequest.requested() (stat of STOP)", "step", stop.requested),
        ("EventLog.emit('progress') (open/append/close)", "step",
         lambda: log.emit(ProgressEvent(step=1, steps=70, loss=0.1, lr=1e-3, samples_per_s=30.0, eta_s=1.0,
                                        epoch=0.25))),
        ("Throughput.tick + rate + eta", "step", lambda: (thr.tick(4), thr.rate(), thr.eta(10, 4))),
    ]
    out = []
    for name, per, fn in pieces:
        for _ in range(warmup_calls):
            fn()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            samples.append((time.perf_counter() - t0) / (calls // 5))
        us = median(samples) * 1e6
        count = plan.per_device * plan.accumulation if per == "sample" else 1
        out.append({"piece": name, "per": per, "us_per_call": round(us, 1), "calls_per_step_per_rank": count,
                    "us_per_step": round(us * count, 1)})
    shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Driver


def spawn(role: str, args, extra: list[str], *, env: dict, torchrun_procs: int = 1, force_torchrun: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    base = [str(Path(__file__).resolve()), "--role", role, "--result", result_path, "--t-spawn", repr(time.time()),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--devices", str(args.devices)] + extra
    if torchrun_procs > 1 or force_torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(torchrun_procs)] + base
    else:
        cmd = [sys.executable] + base
    # The spawn time is passed on the command line, so it is taken just before Popen.
    cmd[cmd.index("--t-spawn") + 1] = repr(time.time())
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    try:
        if done.returncode != 0:
            raise SystemExit(f"{role} run failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
        return json.loads(Path(result_path).read_text())
    finally:
        os.unlink(result_path)


def cpu_ms_per_step(run: dict, warmup: int) -> float | None:
    marks = run.get("cpu_times")
    if not marks or len(marks) <= warmup:
        return None
    return 1000 * (marks[-1] - marks[warmup - 1]) / (len(marks) - warmup)


def usage_per_step(run: dict, warmup: int) -> list[float] | None:
    """[user ms, system ms, minor faults, involuntary switches, voluntary switches] per optimizer step over the
    timed steps."""
    marks = run.get("usage")
    if not marks or len(marks) <= warmup:
        return None
    n = len(marks) - warmup
    a, b = marks[warmup - 1], marks[-1]
    return [1000 * (b[0] - a[0]) / n, 1000 * (b[1] - a[1]) / n] + [(b[i] - a[i]) / n for i in range(2, len(a))]


def summarise(name: str, runs: list[dict], warmup: int) -> dict:
    engine = name.startswith("engine")  # "engine" or "engine+compile"
    rates = [rate(r["times"], warmup, r["total"]) for r in runs]
    cpu = [cpu_ms_per_step(r, warmup) for r in runs]
    usage = [u for u in (usage_per_step(r, warmup) for r in runs) if u]
    return {
        "loop": name,
        "samples_per_s": median([r[0] for r in rates]),
        "step_ms": median([r[1] for r in rates]),
        "best_step_ms": min(r[1] for r in rates),
        "cpu_ms_per_step": median(cpu),
        "user_ms_per_step": median([u[0] for u in usage]),
        "system_ms_per_step": median([u[1] for u in usage]),
        "minor_faults_per_step": median([u[2] for u in usage]),
        "preemptions_per_step": median([u[3] for u in usage]),
        "voluntary_switches_per_step": median([u[4] for u in usage if len(u) > 4]),
        "samples_per_s_all": [round(r[0], 2) for r in rates],
        "step_ms_all": [round(r[1], 1) for r in rates],
        "cpu_ms_per_step_all": [round(c, 1) if c is not None else None for c in cpu],
        "peak_mb": median([r["cuda_peak_mb"] if r["cuda_peak_mb"] is not None else r["worker_rss_mb"] for r in runs]),
        "peak_kind": "cuda max_memory_allocated" if runs[0]["cuda_peak_mb"] is not None else "worker max RSS",
        "startup_s": median([r["startup_s"] for r in runs]),
        "startup_s_all": [round(r["startup_s"], 2) for r in runs],
        **({"polled_hwm_mb": median([r.get("polled_hwm_mb") for r in runs]),
            "reported_samples_per_s": median([r["reported_samples_per_s"] for r in runs]),
            "compile_s": median([r["compile_s"] for r in runs]), "compile_s_all": [r["compile_s"] for r in runs]}
           if engine else {}),
        **({"imports_s": median([r["imports_s"] for r in runs]), "setup_s": median([r["setup_s"] for r in runs])}
           if not engine else {}),
        **({k: median([r[k] for r in runs]) for k in ("launcher_s", "worker_start_s", "worker_imports_s",
                                                      "worker_setup_s")} if engine else {}),
        **({"first_step_s": median([r["first_step_s"] for r in runs])} if not engine else {}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="timed optimizer steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=10, help="optimizer steps before timing starts")
    p.add_argument("--devices", default=None, help="the preset's `devices` (default: cpu:1, or 1 GPU with CUDA)")
    p.add_argument("--repeats", type=int, default=3, help="engine/plain pairs; the median is reported")
    p.add_argument("--work-dir", default=str(REPO_ROOT / ".cache" / "bench"),
                   help="demo assets and run folders (default .cache/bench, git-ignored)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for all loops (default: the engine's choice, "
                   "cores / processes)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-breakdown", action="store_true", help="skip timing the engine's per-sample pieces")
    p.add_argument("--keep-runs", action="store_true", help="keep the engine's run folders")
    p.add_argument("--compile", action="store_true",
                   help="run the engine without and with train.compile (no plain loops): compile time and step time")
    p.add_argument("--no-ddp-variant", action="store_true",
                   help="on one process, skip the plain loop launched under torchrun (1-rank DDP, like the engine)")
    p.add_argument("--name", default="bench-engine", help=argparse.SUPPRESS)
    p.add_argument("override", nargs="*", help="extra KEY=VALUE preset overrides for all loops")
    p.add_argument("--role", choices=("engine", "plain"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--t-spawn", help=argparse.SUPPRESS)
    p.add_argument("--assets", help=argparse.SUPPRESS)
    p.add_argument("--runs-dir", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")

    if args.role:
        result = engine_role(args) if args.role == "engine" else plain_role(args)
        if result is not None:
            Path(args.result).write_text(json.dumps(result))
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from trainer.families.sd.demo import ensure_demo_assets
    from trainer.core.launcher import build_env, plan_for

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # build_env keeps a value that is already set
    if args.devices is None:
        args.devices = "1" if torch.cuda.is_available() else "cpu:1"
    work = Path(args.work_dir).resolve()
    assets = ensure_demo_assets(work / "demo")
    runs_dir = work / "runs"
    config = engine_config(args, assets)
    plan = plan_for(config)
    env = build_env(plan)  # the same CUDA_VISIBLE_DEVICES / OMP_NUM_THREADS the engine's workers get
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = json.dumps(plain_settings(config, plan))
    print(f"plan: {plan.line()}; {args.warmup} warm-up + {args.steps} timed steps; {args.repeats} repeats; "
          f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}", flush=True)

    # One process started by torchrun: accelerate then sets up a 1-rank process group and wraps the model in DDP,
    # which plain `python` does not. The "plain+ddp" row is the plain loop started the engine's way, to separate
    # that cost from the engine's own code. (With more processes the plain loop always runs under torchrun.)
    loops = ["engine", "plain"] + (["plain+ddp"] if plan.world_size == 1 and not args.no_ddp_variant else [])
    if args.compile:
        loops = ["engine", "engine+compile"]
    runs: dict[str, list[dict]] = {name: [] for name in loops}
    engine_extra = ["--assets", json.dumps({k: str(v) for k, v in assets.items()}), "--runs-dir", str(runs_dir),
                    "--name", args.name] + (["--keep-runs"] if args.keep_runs else []) + list(args.override)
    for i in range(args.repeats):
        # Rotate the order so slow drift of a shared machine does not always favour one side.
        for name in loops[i % len(loops):] + loops[: i % len(loops)]:
            if name.startswith("engine"):
                r = spawn("engine", args, engine_extra + (["train.compile=true"] if name != "engine" else []), env=env)
            else:
                r = spawn("plain", args, ["--settings", settings], env=env, torchrun_procs=plan.world_size,
                          force_torchrun=name == "plain+ddp")
            runs[name].append(r)
            sps, ms = rate(r["times"], args.warmup, r["total"])
            cpu = cpu_ms_per_step(r, args.warmup)
            u = usage_per_step(r, args.warmup) or [None] * 5
            print(f"  repeat {i + 1} {name:14s}: {sps:8.2f} samples/s  {ms:7.1f} ms/step  {fmt(cpu, 1):>7s} CPU-ms/step "
                  f"(user {fmt(u[0], 1)}, sys {fmt(u[1], 1)}; per step {fmt(u[2], 0)} page faults, {fmt(u[3], 1)} "
                  f"preemptions, {fmt(u[4], 1)} voluntary switches, all threads)  startup {r['startup_s']:.1f} s", flush=True)

    summary = {name: summarise(name, runs[name], args.warmup) for name in loops}
    eng = summary["engine"]

    def pct(a, b):
        return 100 * (a / b - 1) if a is not None and b else None

    headers = ["loop", "samples/s", "step time ms", "best step time ms", "CPU-ms per step",
               f"peak memory MB ({eng['peak_kind']})", "startup s (spawn -> step 1 done)"]
    rows = [[s["loop"], fmt(s["samples_per_s"], 2), fmt(s["step_ms"], 1), fmt(s["best_step_ms"], 1),
             fmt(s["cpu_ms_per_step"], 1), fmt(s["peak_mb"], 0), fmt(s["startup_s"], 1)] for s in summary.values()]
    table = markdown_table(headers, rows)
    print()
    print(f"medians of {args.repeats} repeats ({args.steps} timed steps after {args.warmup} warm-up steps each):")
    print(table)
    print()
    overheads = {}
    for base in [name for name in loops if name.startswith("plain")]:
        ref = summary[base]
        overheads[base] = {
            "step_time_pct": pct(eng["step_ms"], ref["step_ms"]),
            "best_step_time_pct": pct(eng["best_step_ms"], ref["best_step_ms"]),
            "cpu_time_pct": pct(eng["cpu_ms_per_step"], ref["cpu_ms_per_step"]),
            "cpu_ms_per_step": (eng["cpu_ms_per_step"] - ref["cpu_ms_per_step"])
            if eng["cpu_ms_per_step"] is not None and ref["cpu_ms_per_step"] is not None else None,
            "peak_memory_pct": pct(eng["peak_mb"], ref["peak_mb"]),
        }
        o = overheads[base]
        print(f"engine vs {base}: step time {fmt(o['step_time_pct'], 1)}% (median), {fmt(o['best_step_time_pct'], 1)}% "
              f"(best of {args.repeats}); CPU time per step {fmt(o['cpu_time_pct'], 1)}% "
              f"({fmt(o['cpu_ms_per_step'], 1)} ms per optimizer step of {plan.total} samples); "
              f"peak memory {fmt(o['peak_memory_pct'], 1)}%")
    print("(CPU time: all threads of the rank-0 training process between the end of the warm-up and the last step; "
          "other tenants of a shared machine disturb it far less than wall-clock time)")
    torchrun_share = median([r["torchrun_cpu_share"] for r in runs["engine"]])  # None for one process
    print(f"engine memory cross-check: the launcher's VmHWM poll of the worker saw {fmt(eng.get('polled_hwm_mb'), 0)} MB; "
          f"torchrun itself (agent + log tee) used {fmt(100 * torchrun_share if torchrun_share is not None else None, 1)}% "
          f"of a core during the timed steps")
    print(f"startup (medians): engine {eng['startup_s']:.1f} s = launcher until torchrun started {eng['launcher_s']:.1f} "
          f"+ torchrun until the worker runs {eng['worker_start_s']:.1f} + worker imports {eng['worker_imports_s']:.1f} "
          f"+ worker setup and step 1 {eng['worker_setup_s']:.1f}")
    for name in [name for name in loops if name.startswith("plain")]:
        s_ = summary[name]
        print(f"startup (medians): {name} {s_['startup_s']:.1f} s = interpreter(s) start + imports {s_['imports_s']:.1f} "
              f"+ model and data setup {s_['setup_s']:.1f} + step 1 {s_['first_step_s']:.1f}")
    for name, s in summary.items():
        print(f"per-repeat {name}: step ms {s['step_ms_all']}; CPU-ms/step {s['cpu_ms_per_step_all']}")
    print(f"the engine's own last progress event said {eng['reported_samples_per_s']} samples/s (last 20 steps, median)")
    compiled = summary.get("engine+compile")
    if compiled:
        print(f"train.compile: compiling took {fmt(compiled['compile_s'], 1)} s (median; per repeat "
              f"{compiled['compile_s_all']}); step time {fmt(pct(compiled['step_ms'], eng['step_ms']), 1)}% (median), "
              f"{fmt(pct(compiled['best_step_ms'], eng['best_step_ms']), 1)}% (best); CPU time per step "
              f"{fmt(pct(compiled['cpu_ms_per_step'], eng['cpu_ms_per_step']), 1)}%; startup (spawn -> step 1 done) "
              f"{compiled['startup_s'] - eng['startup_s']:+.1f} s")
    result = {"plan": plan.line(), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "omp_num_threads": env.get("OMP_NUM_THREADS"), "loops": summary, "engine_overhead": overheads,
              "torchrun_cpu_share": torchrun_share, "table": table, "load_average": os.getloadavg(),
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                          "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}

    if not args.no_breakdown:
        pieces = breakdown(config, plan)
        rows = [[b["piece"], b["per"], fmt(b["us_per_call"], 1), b["calls_per_step_per_rank"], fmt(b["us_per_step"], 1)]
                for b in pieces]
        print()
        print("engine-only work, timed in isolation (median of 5 x 400 calls, this process):")
        print(markdown_table(["piece", "per", "us per call", "calls per step", "us per step"], rows))
        result["breakdown"] = pieces
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
