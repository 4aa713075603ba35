"""Try a checkpoint before downloading it: one prompt drawn by the base model alone and by the base with the
checkpoint's trained weights, same seed, side by side. The Runs tab's Generate panel runs it as a process of its
own (the UI stays torch-free), as a user would:

    python -m trainer.engine.generate RUN_DIR --step N --prompt "a sks dog" [--seed 0 --steps 25 --guidance 7.5
                                      --scale 1.0] --out RUN_DIR/generated/NAME

The family draws both through its own `render_samples`, with `sample.*` set to this request, so what it shows is
what the run's samples would show. `--scale` weighs the trained change: trained = base + scale x (checkpoint -
base) for every trained tensor but a LoRA's down (A) matrices, which stay as trained, so a LoRA's delta B.A
scales by exactly `scale` (its up matrices start at zero); a full fine-tune's weights are interpolated.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from trainer.core.outputs import pick_checkpoint
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError

RESULT = "result.json"
PROGRESS = "generate: "  # the start of a progress line (app.generations shows them)
LORA_DOWN = (".lora_A.", ".lora_down.")  # kept as trained when scaling (see the module's docstring)


def scaled_state(base: dict, trained: dict, scale: float) -> dict:
    """The trained weights with their change from `base` weighed by `scale`."""
    out = {}
    for key, value in trained.items():
        if any(part in key for part in LORA_DOWN) or key not in base:
            out[key] = value
        else:
            out[key] = base[key] + scale * (value - base[key])
    return out


def generate(run_dir: Path, step: int | None, prompt: str, out_dir: Path, *, seed: int = 0, steps: int = 25,
             guidance: float = 7.5, scale: float = 1.0) -> dict:
    """Draw `prompt` with the base and with checkpoint `step` (the newest when None); writes base.png, tuned.png
    and result.json (the request, the step, the device) into `out_dir`, and returns what result.json holds."""
    import torch
    from accelerate import Accelerator

    from trainer.core.config.load import load_config
    from trainer.core.plan import Plan
    from trainer.engine.chatter import quiet_library_chatter
    from trainer.engine.export import _swap_in_ema
    from trainer.engine.ema import build_ema
    from trainer.engine.run_io import load_weights
    from trainer.families import get_family, spec_of
    from trainer.families.protocol import WorkerContext

    folder = RunFolder(run_dir)
    config = load_config(folder.config, check_paths=False)
    if not spec_of(config.model.family).generates:
        raise UserError(f"Generate draws images from a prompt; a {config.model.family} run does not (its samples "
                        "show its predictions instead).")
    if not prompt.strip():
        raise UserError("Generate needs a prompt.")
    ckpt = pick_checkpoint(run_dir, step)
    quiet_library_chatter(run_dir)
    say = lambda line: print(f"{PROGRESS}{line}", flush=True)  # noqa: E731  (app.generations passes them on)
    say(f"loading the model for step {ckpt.step}")
    sample = replace(config.sample, prompts=[prompt], seed=seed, steps=steps, guidance_scale=guidance,
                     images_per_prompt=1, concept=replace(config.sample.concept, prompt=""),
                     control=replace(config.sample.control, prompt=""))
    config = replace(config, sample=sample)
    plan = Plan.from_event(folder.read_plan())
    acc = Accelerator(cpu=not (plan.device == "cuda" and torch.cuda.is_available()))
    ctx = WorkerContext(config=config, plan=plan, run_dir=run_dir, cache_dir=run_dir.parent / ".cache",
                        device=acc.device, rank=0, world_size=1, accelerator=acc,
                        log_warning=lambda message: print(f"warning: {message}", flush=True))
    family = get_family(config.model.family)(ctx)
    family.load()
    base = {k: v.detach().clone() for k, v in family.trainable_state().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"drawing the base alone ({steps} steps on {acc.device})")
    drawn = {"base": family.render_samples(0)[0][1][0]}
    say(f"drawing the base with step {ckpt.step} at LoRA scale {scale:g}")
    load_weights(family, ckpt.path)
    _swap_in_ema(family, config, plan, ckpt, build_ema, ctx.log_warning)
    if scale != 1.0:
        family.load_trainable_state(scaled_state(base, family.trainable_state(), scale))
    drawn["tuned"] = family.render_samples(ckpt.step)[0][1][0]
    for name, image in drawn.items():
        tmp = out_dir / f".{name}.png"
        image.save(tmp, format="PNG")
        tmp.rename(out_dir / f"{name}.png")
    result = {"step": ckpt.step, "prompt": prompt, "seed": seed, "steps": steps, "guidance": guidance,
              "scale": scale, "device": str(acc.device)}
    (out_dir / RESULT).write_text(json.dumps(result, indent=2) + "\n")  # last: its presence says "done"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="draw a prompt with a run's base and with one of its checkpoints")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int)
    p.add_argument("--prompt", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        result = generate(args.run_dir, args.step, args.prompt, args.out, seed=args.seed, steps=args.steps,
                          guidance=args.guidance, scale=args.scale)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"generated step {result['step']} on {result['device']}: {args.out}/base.png, {args.out}/tuned.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
