"""output.push_to_hub: a finished run's outputs, its last samples and a generated model card, uploaded to a Hugging
Face Hub model repo through huggingface_hub (HF_ENDPOINT picks the Hub). Torch-free.

The token is huggingface_hub's own lookup (HF_TOKEN, else the `hf auth login` file): it is never passed around,
printed or written here, and an error message is reduced to its first line, which huggingface_hub keeps free of it.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.core.config import Config
from trainer.core.config.validate import is_hub_id
from trainer.core.runfolder import RunFolder
from trainer.core.registry import spec_of

_SAMPLE = re.compile(r"^step-(\d+)-p(\d+)\.png$")
DEMO_LICENCE = "apache-2.0"  # demo://tiny-sd ships with imagetune, under its licence


def last_samples(run_dir: Path) -> list[Path]:
    """Each prompt's sample from the run's last sample step (samples/step-NNNNNN-pKK.png)."""
    found = [(int(m.group(1)), p) for p in RunFolder(run_dir).samples.glob("step-*.png")
             if (m := _SAMPLE.match(p.name))]
    if not found:
        return []
    last = max(step for step, _ in found)
    return sorted(p for step, p in found if step == last)


SHIPPED = Path(__file__).resolve().parents[1] / "assets"  # demo://tiny-sd, resolved to its folder in a run's config


def _shipped(model_path: str) -> bool:
    return model_path.startswith("demo://") or Path(model_path).resolve().is_relative_to(SHIPPED)


def base_licence(model_path: str) -> str:
    """The base model's licence as its Hub card states it; `other` when it cannot be read (a local model)."""
    if _shipped(model_path):
        return DEMO_LICENCE
    if not is_hub_id(model_path):
        return "other"
    try:
        from huggingface_hub import HfApi

        card = HfApi().model_info(model_path).card_data
        licence = card.get("license") if card is not None else None
        return str(licence) if licence else "other"
    except Exception:  # a gated or missing repo, no network: the card says `other` and names the base model
        return "other"


def trigger_words(config: Config) -> list[str]:
    words = [config.data.caption_prefix.strip().rstrip(","), config.data.instance_prompt or ""]
    words += [entry.caption_prefix or "" for entry in config.data.datasets]
    words += [entry.instance_prompt or "" for entry in config.data.datasets if not entry.is_regularization]
    return list(dict.fromkeys(w.strip() for w in words if w and w.strip()))


def model_card(config: Config, repo_id: str, licence: str, samples: list[Path], step: int, *, precision: str,
               files: list[str]) -> str:
    """README.md of the repo: the Hub's metadata (base model, licence, tags, trigger) and what a user needs."""
    spec = spec_of(config.model.family)
    lora = config.method == "lora"
    triggers = trigger_words(config)
    t = config.train
    tags = ["imagetune", "text-to-image", "diffusers", config.model.family] + (["lora"] if lora else [])
    base = config.model.path
    hub_base = is_hub_id(base)
    # The Hub's base_model must be a repo id: a local or shipped base is named in the text only (by its folder
    # name, not its path on this machine).
    named = f"[{base}](https://huggingface.co/{base})" if hub_base else (
        f"imagetune's demo base `{Path(base).name}`" if _shipped(base) else f"a local model (`{Path(base).name}`)")
    front = ["---", *([f"base_model: {base}"] if hub_base else []), f"license: {licence}",
             "library_name: diffusers", "tags:", *[f"- {tag}" for tag in tags]]
    if triggers:
        front.append(f"instance_prompt: {_yaml_string(triggers[0])}")
    front.append("---")
    what = (f"a {config.lora.type.upper() if config.lora.type != 'lora' else 'LoRA'} (rank {config.lora.rank}, "
            f"alpha {config.lora.alpha:g})" if lora else "a full fine-tune")
    lines = [*front, "", f"# {config.name}", "",
             f"{what[0].upper()}{what[1:]} of {named} ({spec.title}), "
             f"trained with imagetune for {step} steps.", ""]
    if triggers:
        lines += ["## Trigger words", "", "Use " + ", ".join(f"`{w}`" for w in triggers) + " in your prompt.", ""]
    if lora:
        lines += ["## Use", "", "```python", "from diffusers import DiffusionPipeline", "",
                  f'pipe = DiffusionPipeline.from_pretrained("{base if hub_base else "BASE_MODEL"}")',
                  f'pipe.load_lora_weights("{repo_id}")', "```", "",
                  *([f"`{config.name}_kohya.safetensors` is the same weights for ComfyUI, Forge and A1111.", ""]
                    if f"{config.name}_kohya.safetensors" in files else [])]
    settings = [("method", config.method), ("steps", step), ("learning rate", f"{t.lr:g}"),
                ("optimizer", t.optimizer), ("schedule", t.scheduler), ("batch", config.batch.total),
                ("resolution", config.data.resolution), ("precision", precision), ("seed", config.seed)]
    lines += ["## Training settings", "", "| setting | value |", "| --- | --- |",
              *[f"| {name} | {value} |" for name, value in settings], "",
              f"The base model's licence ({licence}) applies to this model too.", ""]
    if samples:
        lines += ["## Samples", "", f"At step {step}, one image per prompt of `sample.prompts`:", ""]
        lines += [f"![sample {n}](samples/{path.name})" for n, path in enumerate(samples)] + [""]
    return "\n".join(lines)


def _yaml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def push_outputs(config: Config, run_dir: Path, step: int) -> str:
    """Create the repo (private, if it is new) and upload output/, the last samples and README.md in one commit;
    returns the repo's URL. Raises what huggingface_hub raises."""
    from huggingface_hub import CommitOperationAdd, HfApi

    repo_id = config.output.push_to_hub
    assert repo_id, "only called with output.push_to_hub set"
    folder = RunFolder(run_dir)
    samples = last_samples(run_dir)
    files = [str(p.relative_to(folder.output)) for p in sorted(folder.output.rglob("*")) if p.is_file()]
    card = model_card(config, repo_id, base_licence(config.model.path), samples, step,
                      precision=folder.read_plan().get("precision", config.precision), files=files)
    operations = [CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8"))]
    operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder.output / name)) for name in files]
    operations += [CommitOperationAdd(path_in_repo=f"samples/{p.name}", path_or_fileobj=str(p)) for p in samples]
    api = HfApi()
    url = api.create_repo(repo_id, repo_type="model", private=True, exist_ok=True)
    api.create_commit(repo_id, operations, commit_message=f"{config.name}: imagetune run, step {step}",
                      repo_type="model")
    return str(url)
