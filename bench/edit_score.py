"""Does an edit family's demo learn its edit? Trains `presets/demo-flux-kontext.yaml` (or `--preset
demo-qwenimage-edit.yaml`) through the real launcher (KEY=VALUE overrides apply) and scores the base model and the trained LoRA on held-out pairs of the demo's task
(a shape on a light background -> the same shape on black, generated with another seed than the training pairs):
`edit_score` (trainer/families/components/edit_pairs.py) of each sample's latent against its target's and its
control's, 1 at the target, -1 at the control. The tiny model's VAE is random, so the score is on latents.

    python bench/edit_score.py                                   # the preset as shipped
    python bench/edit_score.py train.lr=1e-2 --pairs 8 --json out.json
    python bench/edit_score.py --preset demo-qwenimage-edit.yaml  # Qwen-Image-Edit's demo

Prints (and with --json writes) the score at step 0 (the base) and at the end, with the run's first and last loss,
and the share of samples whose nearest target is their own (`own_target_nearest_*`, chance: 1 / pairs): whether the
model reads its control image, not only the targets' look. `--run RUN` scores a finished demo run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import trainer.families  # noqa: E402,F401  (fills the family registry, trainer.core.registry)


def _kontext(pipe, control, prompt: str, steps: int, size: int, seed: int):
    import torch

    packed = pipe(prompt=prompt, image=control, height=size, width=size, max_area=size * size, _auto_resize=False,
                  num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="latent",
                  max_sequence_length=16).images
    return pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor)


def _qwen_edit(pipe, control, prompt: str, steps: int, size: int, seed: int):
    """Without a negative prompt, so unguided as Kontext's; the control encoded at the sample's size, as in training
    (trainer/families/qwenimage_edit/family.py `vae_image_area`)."""
    import torch

    from trainer.families.qwenimage_edit.family import vae_image_area

    with vae_image_area(size * size):
        packed = pipe(prompt=prompt, image=control, height=size, width=size, num_inference_steps=steps,
                      generator=torch.Generator().manual_seed(seed), output_type="latent").images
    return pipe._unpack_latents(packed, size, size, pipe.vae_scale_factor)[:, :, 0]  # one frame


# The edit pipelines' calls, by the class the demo model's model_index.json names.
SAMPLERS = {"FluxKontextPipeline": _kontext, "QwenImageEditPlusPipeline": _qwen_edit}


def sample_latents(pipe, controls: list, prompt: str, steps: int, size: int):
    """The pipeline's samples for each control image, as (B, C, h, w) latents (seed i for pair i)."""
    import torch

    sample = SAMPLERS[type(pipe).__name__]
    return torch.cat([sample(pipe, control, prompt, steps, size, i) for i, control in enumerate(controls)])


def distances(samples, controls, targets) -> dict[str, float]:
    """Mean |sample - target|² and |sample - control|², each over |target - control|²: the score's two terms
    apart. `edit_score` reads 0 for noise only where controls and targets have one norm; Qwen-Image's normalised
    latents of a light control are longer than a black target's, so noise scores above 0 there, and these say
    which way a sample moved."""
    s, c, t = (x.flatten(1).double() for x in (samples, controls, targets))
    gap = ((t - c) ** 2).sum(1)
    return {"to_target": float((((s - t) ** 2).sum(1) / gap).mean()),
            "to_control": float((((s - c) ** 2).sum(1) / gap).mean())}


def own_nearest(samples, targets) -> float:
    """The share of samples whose nearest target latent (of all the held-out pairs') is their own: above chance
    (1 / pairs) only for a model that reads its control image, where the shape is."""
    import torch

    distances = torch.cdist(samples.flatten(1).double(), targets.flatten(1).double())
    return float((distances.argmin(1) == torch.arange(len(samples))).double().mean().item())


def encoded(pipe, images: list, size: int):
    """The images' latents as the pipeline encodes its input image (the distribution's mode, normalised); a video
    VAE's (Qwen-Image's) as its one frame."""
    pixels = pipe.image_processor.preprocess(images, size, size)
    if type(pipe).__name__ == "QwenImageEditPlusPipeline":
        return pipe._encode_vae_image(pixels[:, :, None], None)[:, :, 0]
    return pipe._encode_vae_image(pixels, None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE over the demo preset")
    parser.add_argument("--preset", default="demo-flux-kontext.yaml", help="the edit demo's preset (in presets/)")
    parser.add_argument("--pairs", type=int, default=6, help="held-out pairs scored")
    parser.add_argument("--steps", type=int, default=8, help="sampling steps per sample")
    parser.add_argument("--runs-dir", default=None, help="where the run goes (default: a temporary folder)")
    parser.add_argument("--run", default=None, help="score this finished run of the demo instead of training one")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    import yaml
    from diffusers import DiffusionPipeline
    from PIL import Image

    from trainer.core.config import load_config
    from trainer.core.events import read_events
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.launcher import prepare_run, start_run
    from trainer.families.components.edit_pairs import INSTRUCTION, edit_score, make_edit_pairs

    torch.set_grad_enabled(False)
    if args.run:
        run_dir = Path(args.run)
        config = load_config(run_dir / "config.yaml", [])
    else:
        runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="edit-score-"))
        config = load_config(REPO / "presets" / args.preset, ["sample.every=0", *args.overrides])
        run_dir, plan = prepare_run(config, runs, hw=CPU_ONLY)
        final = start_run(run_dir, plan, config).wait(timeout=3600)
        if final["type"] != "done":
            raise SystemExit(f"the run ended {final['type']}: see {run_dir / 'train.log'}")
    model = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"])  # demo:// resolved
    held = Path(tempfile.mkdtemp(prefix="edit-pairs-"))
    size = config.data.resolution
    pairs = {side: [Image.open(p).convert("RGB") for p in sorted(
        make_edit_pairs(held / side, side=side, count=args.pairs, size=size, seed=99).glob("*.png"))]
        for side in ("control", "target")}

    pipe = DiffusionPipeline.from_pretrained(model)  # the class its model_index.json names
    pipe.set_progress_bar_config(disable=True)
    control, target = encoded(pipe, pairs["control"], size), encoded(pipe, pairs["target"], size)
    base = sample_latents(pipe, pairs["control"], INSTRUCTION, args.steps, size)
    scores = {"step_0": edit_score(base, control, target), "own_target_nearest_step_0": own_nearest(base, target),
              "distances_step_0": distances(base, control, target)}
    if config.method == "full":  # the fine-tuned model's diffusers folder
        pipe = DiffusionPipeline.from_pretrained(run_dir / "output" / "diffusers")
        pipe.set_progress_bar_config(disable=True)
    else:
        pipe.load_lora_weights(run_dir / "output")
    trained = sample_latents(pipe, pairs["control"], INSTRUCTION, args.steps, size)
    scores["end"] = edit_score(trained, control, target)
    scores["own_target_nearest_end"] = own_nearest(trained, target)
    scores["distances_end"] = distances(trained, control, target)
    losses = [e["loss"] for e in read_events(run_dir) if e["type"] == "progress"]
    result = {"family": config.model.family, "steps": config.train.steps, "lr": config.train.lr, "pairs": args.pairs, "sampling_steps": args.steps,
              "edit_score": scores, "loss_first": losses[0], "loss_last": losses[-1], "run": str(run_dir)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
