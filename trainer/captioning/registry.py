"""The captioners, as data: a name -> the model to load and how it is prompted. Torch-free.

Three kinds cover the models users of the other trainers caption with:

- `florence2`: transformers' Florence2ForConditionalGeneration; the instruction is a task token
  (`<MORE_DETAILED_CAPTION>`, `<CAPTION>`...).
- `chat`: a chat vision-language model (Qwen2.5-VL, Qwen3-VL, a LLaVA checkpoint such as JoyCaption) prompted
  through its processor's chat template with an editable instruction.
- `tagger`: a WD-style booru tagger through timm: comma-separated tags whose score passes a threshold, the names
  from the repo's selected_tags.csv.

Any other model is named by a local folder or a hub id; its kind follows from its config.json (transformers'
`model_type`, or timm's `architecture` with a selected_tags.csv beside it), so no code branches on a model's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from trainer.errors import UserError

TAGS_FILE = "selected_tags.csv"
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A plain `owner/name`, the only form a hub id may take (no revision, no URL, no path segments)."""


@dataclass(frozen=True)
class CaptionerSpec:
    name: str
    model: str
    """Hub id or local folder."""
    kind: str
    """`florence2`, `chat` or `tagger` (see the module's docstring)."""
    instruction: str = ""
    """What the model is asked: a chat instruction, or Florence-2's task token; unused by a tagger."""
    system: str = ""
    """A chat system message, for models trained with one (JoyCaption)."""
    content: str = "parts"
    """How a chat message's content is given to the chat template: `parts` (an image part and a text part, as
    transformers' Qwen-VL and llava-hf templates take) or `text` (a plain string; the template places the image
    itself, as JoyCaption's does: its model card's usage)."""
    max_new_tokens: int = 256
    threshold: float = 0.35
    """tagger: the score above which a tag is kept."""
    about: str = ""


DEFAULT_INSTRUCTION = {
    "florence2": "<MORE_DETAILED_CAPTION>",
    "chat": "Describe this image in one detailed paragraph for a text-to-image training caption. Describe only "
            "what is visible: subjects, clothing, pose, setting, lighting, style. No preamble.",
    "tagger": "",
}

CAPTIONERS: dict[str, CaptionerSpec] = {spec.name: spec for spec in (
    CaptionerSpec("florence2", "florence-community/Florence-2-large", "florence2", DEFAULT_INSTRUCTION["florence2"],
                  about="Florence-2 large (0.8B): fast detailed captions"),
    CaptionerSpec("florence2-base", "florence-community/Florence-2-base", "florence2",
                  DEFAULT_INSTRUCTION["florence2"], about="Florence-2 base (0.2B): the smallest, CPU-friendly"),
    CaptionerSpec("qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct", "chat", DEFAULT_INSTRUCTION["chat"],
                  about="Qwen2.5-VL 7B (what musubi-tuner uses): natural-language captions, editable instruction"),
    CaptionerSpec("qwen3-vl", "Qwen/Qwen3-VL-8B-Instruct", "chat", DEFAULT_INSTRUCTION["chat"],
                  about="Qwen3-VL 8B (what ai-toolkit uses): natural-language captions, editable instruction"),
    CaptionerSpec("joycaption", "fancyfeast/llama-joycaption-beta-one-hf-llava", "chat",
                  "Write a long descriptive caption for this image in a formal tone.",
                  system="You are a helpful image captioner.", content="text", max_new_tokens=512,
                  about="JoyCaption beta one (a LLaVA checkpoint): uncensored descriptive captions"),
    CaptionerSpec("wd-tagger", "SmilingWolf/wd-eva02-large-tagger-v3", "tagger",
                  about="WD EVA02 large tagger v3 (timm): booru tags for anime-style images, with a threshold"),
)}
DEFAULT_CAPTIONER = "florence2"

CHAT_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
"""transformers model types captioned through a chat template (their processors place the image tokens)."""
MODEL_TYPE_KIND = {"florence2": "florence2", **{t: "chat" for t in CHAT_MODEL_TYPES}}


def resolve(name_or_path: str | None, instruction: str | None = None, threshold: float | None = None,
            config_of=None) -> CaptionerSpec:
    """The captioner a `--captioner` value names: a registry name, a local model folder, or a hub id `owner/name`
    (its config.json fetched by `config_of`, default huggingface_hub). `instruction` / `threshold` replace the
    spec's own when given."""
    value = (name_or_path or DEFAULT_CAPTIONER).strip()
    if value in CAPTIONERS:
        spec = CAPTIONERS[value]
    else:
        folder = Path(value).expanduser()
        if folder.is_dir():
            spec = _from_config(value, _local_config(folder), (folder / TAGS_FILE).is_file())
        elif HUB_ID.match(value) and not value.startswith((".", "/")):
            config, has_tags = (config_of or hub_config)(value)
            spec = _from_config(value, config, has_tags)
        else:
            raise UserError(f"--captioner {value!r} is neither a captioner ({', '.join(CAPTIONERS)}), a model folder "
                            "that exists, nor a hub id of the form owner/name. Name one of those.")
    if instruction is not None and instruction.strip():
        spec = replace(spec, instruction=instruction.strip())
    if threshold is not None:
        if not 0.0 < threshold < 1.0:
            raise UserError(f"--threshold {threshold}: a tag's score is between 0 and 1; pick a value in between "
                            "(0.35 is usual; lower keeps more tags).")
        spec = replace(spec, threshold=float(threshold))
    return spec


def _local_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--captioner {folder}: the folder has no config.json, so it is no saved transformers or timm "
                        "model. Point at the folder save_pretrained wrote (or a hub download of one).") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"--captioner {folder}: its config.json cannot be read ({exc}).") from None


def hub_config(repo: str) -> tuple[dict, bool]:
    """A hub model's config.json and whether it ships selected_tags.csv (network; the download is cached)."""
    try:
        from huggingface_hub import hf_hub_download, list_repo_files

        path = hf_hub_download(repo, "config.json")
        has_tags = TAGS_FILE in list_repo_files(repo)
        return json.loads(Path(path).read_text(encoding="utf-8")), has_tags
    except Exception as exc:  # huggingface_hub's errors: not found, gated, offline
        raise UserError(f"--captioner {repo}: its config.json could not be fetched from the Hub ({type(exc).__name__}: "
                        f"{(str(exc).strip().splitlines() or [''])[0][:200]}). Check the id, your network and "
                        "HF_TOKEN for a gated model, or give a downloaded folder's path.") from None


def _from_config(model: str, config: dict, has_tags: bool) -> CaptionerSpec:
    if "architecture" in config and has_tags:
        return CaptionerSpec(Path(model).name or model, model, "tagger")
    kind = MODEL_TYPE_KIND.get(str(config.get("model_type", "")))
    if kind is None:
        known = ", ".join(sorted(MODEL_TYPE_KIND))
        raise UserError(f"--captioner {model}: model_type {config.get('model_type')!r} is not a captioner imagetune "
                        f"knows (transformers model types {known}, or a timm tagger with {TAGS_FILE}). Use one of "
                        f"those, or a name from: {', '.join(CAPTIONERS)}.")
    return CaptionerSpec(Path(model).name or model, model, kind, DEFAULT_INSTRUCTION[kind])
