"""Loading a captioner and asking it about one image. torch, transformers and timm are imported here only.

On a GPU the model runs in bf16 (fp16 where bf16 is not supported), on the CPU in fp32. `close()` drops the model
and empties the CUDA cache, so a captioner run from the UI process chain leaves no memory behind for the run
that follows.
"""

from __future__ import annotations

import csv
import gc
from pathlib import Path
from typing import Any

from trainer.captioning.registry import TAGS_FILE, CaptionerSpec
from trainer.errors import UserError

TIMM_EXTRA = "pip install 'imagetune[caption]'  (or: pip install 'timm>=1.0')"


def device_and_dtype() -> tuple[Any, Any]:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.device("cpu"), torch.float32


class Captioner:
    """One loaded model; `caption(image)` -> text (a tagger: its tags joined by ", ")."""

    def __init__(self, spec: CaptionerSpec, model: Any, processor: Any, device: Any, dtype: Any):
        self.spec, self.model, self.processor, self.device, self.dtype = spec, model, processor, device, dtype
        self.tags: list[str] = []

    def caption(self, image) -> str:
        import torch

        with torch.inference_mode():
            return {"florence2": self._florence2, "chat": self._chat, "tagger": self._tagger}[self.spec.kind](image)

    def _generate(self, inputs) -> list[int]:
        inputs = inputs.to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        out = self.model.generate(**inputs, max_new_tokens=self.spec.max_new_tokens, do_sample=False)
        if not self.model.config.is_encoder_decoder:
            out = out[:, inputs["input_ids"].shape[1]:]  # a decoder-only model repeats the prompt first
        return out

    def _florence2(self, image) -> str:
        inputs = self.processor(text=self.spec.instruction, images=image, return_tensors="pt")
        return self.processor.batch_decode(self._generate(inputs), skip_special_tokens=True)[0].strip()

    def _chat(self, image) -> str:
        def message(role: str, text: str, image: bool = False) -> dict:
            if self.spec.content == "text":
                return {"role": role, "content": text}
            return {"role": role, "content": [*([{"type": "image"}] if image else []), {"type": "text", "text": text}]}

        messages = [message("system", self.spec.system)] if self.spec.system else []
        messages.append(message("user", self.spec.instruction, image=True))
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[prompt], images=[image], return_tensors="pt")
        return self.processor.batch_decode(self._generate(inputs), skip_special_tokens=True)[0].strip()

    def _tagger(self, image) -> str:
        import torch

        pixels = self.processor(_square(image)).unsqueeze(0)[:, [2, 1, 0]]  # the WD taggers were trained on BGR
        scores = torch.sigmoid(self.model(pixels.to(self.device, self.dtype)).float())[0].tolist()
        ranked = sorted(((s, t) for s, t in zip(scores, self.tags) if t and s > self.spec.threshold), reverse=True)
        return ", ".join(tag.replace("_", " ") for _, tag in ranked)

    def close(self) -> None:
        """Release the model's memory (CPU and GPU)."""
        import torch

        self.model = self.processor = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _square(image):
    """Padded to a white square, as the WD taggers were trained (their crop would cut tall images' heads)."""
    from PIL import Image

    image = image.convert("RGB")
    side = max(image.size)
    canvas = Image.new("RGB", (side, side), (255, 255, 255))
    canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return canvas


def load(spec: CaptionerSpec) -> Captioner:
    """The model and its processor from a local folder or the Hub; any failure is one UserError."""
    device, dtype = device_and_dtype()
    if spec.kind == "tagger":
        return _load_tagger(spec, device, dtype)
    try:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(spec.model)
        model = AutoModelForImageTextToText.from_pretrained(spec.model, dtype=dtype)
    except Exception as exc:  # missing files, a gated repo, no network, a wrong folder: all the user's to fix
        raise _unloadable(spec, exc) from None
    return Captioner(spec, model.to(device).eval(), processor, device, dtype)


def _load_tagger(spec: CaptionerSpec, device, dtype) -> Captioner:
    try:
        import timm
        import timm.data
    except ImportError:
        raise UserError(f"The {spec.name} tagger needs timm, an optional extra: {TIMM_EXTRA}.") from None
    try:
        folder = Path(spec.model).expanduser()
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(spec.model, allow_patterns=["config.json", "*.safetensors", TAGS_FILE]))
        model = timm.create_model(f"local-dir:{folder}", pretrained=True)
        with open(folder / TAGS_FILE, newline="", encoding="utf-8") as f:
            tags = [row["name"] for row in csv.DictReader(f)]
        transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    except Exception as exc:
        raise _unloadable(spec, exc) from None
    if len(tags) != model.num_classes:
        raise UserError(f"--captioner {spec.model}: {TAGS_FILE} names {len(tags)} tags for a model with "
                        f"{model.num_classes} outputs; they are not from the same tagger.")
    captioner = Captioner(spec, model.to(device, dtype).eval(), transform, device, dtype)
    captioner.tags = tags
    return captioner


def _unloadable(spec: CaptionerSpec, exc: Exception) -> UserError:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return UserError(f"--captioner {spec.model}: the {spec.kind} model could not be loaded ({type(exc).__name__}: "
                     f"{first}). Check the hub id or folder (a folder must hold what save_pretrained wrote, with its "
                     "processor), your network, and HF_TOKEN for a gated model.")
