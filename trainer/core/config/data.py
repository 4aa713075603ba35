"""The `data` section of the schema: the training images, their captions and augmentation, held-out images and
masks (diffusion families), or a detection dataset's description. `data.datasets` entries are
trainer.core.config.datasets; the resolved folders are trainer.core.data.sources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from trainer.core.config.datasets import DatasetEntry
from trainer.core.config.fields import key


@dataclass
class DataConfig:
    path: str = key(
        "",
        "Training images: a folder of images with same-name `.txt` captions, kohya `N_prompt` sub-folders "
        "(N repeats), or a `metadata.jsonl`. `demo://demo-data` is the offline demo set. Detection: a COCO "
        "`.json` file, a YOLO `data.yaml`, or a folder holding `data.yaml` or `train.json` (+ `val.json`); "
        "`demo://shapes-coco` is the offline detection demo set.",
    )
    datasets: list[DatasetEntry] = field(default_factory=list, metadata={"help": (
        "Several image folders in one run instead of data.path, each a mapping with its own `path`, `repeats`, "
        "`resolution`, `flip`, `instance_prompt`, `caption_extension`, caption settings (`caption_prefix`, "
        "`caption_dropout`, `shuffle_tags`, `keep_tokens`) and `is_regularization`; what an entry leaves unset "
        "is the data.* key of that name. E.g. `[{path: dog, repeats: 2}, {path: style, resolution: 768}, "
        "{path: reg, is_regularization: true}]`. Diffusion families only."), "choices": None, "group": None})
    instance_prompt: Optional[str] = key(None, "Caption for images that have none (e.g. `a photo of sks dog`).")
    caption_extension: str = key(".txt", "Extension of caption files next to the images.")
    resolution: int = key(512, "Training resolution in pixels (square); a multiple of 8. Detection: the longest "
                               "image side (images keep their aspect ratio; SSDlite uses a square of this size).")
    center_crop: bool = key(True, "Center-crop to the resolution; false crops at random (disables latent caching).")
    flip: bool = key(False, "Randomly flip images horizontally (latents of both sides are cached).")
    cache_latents: bool = key(True, "Encode each image with the VAE once, not every step, when augmentation allows.")
    workers: Union[int, str] = key(
        "auto",
        "Input processes per training process (a torch DataLoader over the stream's positions): they read, decode "
        "and augment the next micro-batches while the step runs, pinned for a non-blocking copy on GPUs. Every "
        "sample is the same with any number (its draws are seeded by its position), also after a resume. `auto`: "
        "0 on the CPU (the training processes use every core), on GPUs min(4, CPU cores per process - 1). 0 loads "
        "each micro-batch on the training thread when its step starts. How long each step waited for its data is "
        "in the `progress` events (`data_s`).")
    bucketing: bool = key(
        False,
        "Aspect-ratio buckets (SDXL, SD3, FLUX, SD 1.x/2.x): train each image at the bucket shape nearest to its "
        "own aspect ratio, all of about `resolution`² pixels (sides multiples of `data.bucket_step`), instead of "
        "a center-cropped square. Every optimizer step's batch comes from one bucket; the plan lists the buckets.",
    )
    bucket_step: int = key(64, "Bucket sides are multiples of this many pixels (a multiple of 8; 64 suits every "
                               "family: FLUX/SD3 need multiples of 16, SDXL's UNet 32).")
    bucket_max_aspect: float = key(4.0, "Most elongated bucket allowed: long side / short side (4.0: 1:4 to 4:1).")
    bucket_min_side: Optional[int] = key(None, "Smallest bucket side in pixels; unset: only `bucket_max_aspect` "
                                               "limits it.")
    bucket_max_side: Optional[int] = key(None, "Largest bucket side in pixels; unset: resolution x "
                                               "sqrt(bucket_max_aspect).")
    val_split: float = key(
        0.0,
        "Fraction of data.path's images held out of training for the validation loss (0: none; 0.1: one image in "
        "ten). Which images is decided by `seed` and each image's path, by image (kohya repeats do not count), the "
        "same on any number of processes; at least one image is held out and at least one must stay to train. "
        "Every `eval.every` steps and at the end the run reports `val_loss` in its `eval` events: the mean loss "
        "over the held-out images, each at the same noise and timestep at every evaluation (center crop, no flip), "
        "weighted as the training loss is (Min-SNR for SD/SDXL, `flow.weighting` for SD3/FLUX), so the numbers "
        "compare across steps, process counts and resumes; `eval.best` keeps the weights of the lowest. Not for "
        "detection, which evaluates on its own validation set.",
    )
    val_path: str = key(
        "",
        "A folder of captioned images (the layouts data.path takes) to compute `val_loss` on instead of a split of "
        "data.path; never trained on. Use either this or `data.val_split`, not both.",
    )
    cache_text_embeddings: Optional[bool] = key(
        None,
        "Encode each caption with the text encoders once (cached on disk), then move the frozen encoders off the "
        "GPU; ignored while a text encoder is trained. Unset: the family's default (on for SDXL, SD3 and FLUX, whose "
        "samples then come from the cached prompt embeddings too; off with data.shuffle_tags, whose captions are "
        "new at almost every step). The cache holds the captions with data.caption_prefix and, with "
        "data.caption_dropout, the empty caption. SD 1.x/2.x always encodes captions per step.",
    )
    caption_prefix: str = key(
        "",
        "Text put in front of every training and held-out image's caption, followed by a space (kohya's "
        "`caption_prefix`), e.g. a trigger word `sks`, or `sks,` for comma-separated tags; never shuffled and never "
        "counted in data.keep_tokens. Not added to prior.class_prompt or the sample prompts.",
    )
    caption_dropout: float = key(
        0.0,
        "Probability of training a sample with the empty caption instead of its own (prefix included), as kohya's "
        "`caption_dropout_rate`: the model also learns the unconditional prediction that classifier-free guidance "
        "uses (0.05-0.1 usual; 0: never). Drawn per sample from its place in the run, the same on any number of "
        "processes and after a resume. Held-out and prior-preservation images keep their captions. The text cache "
        "holds the empty caption as one more entry.",
    )
    shuffle_tags: bool = key(
        False,
        "Shuffle each training caption's comma-separated tags per sample (kohya's `shuffle_caption`), keeping the "
        "first data.keep_tokens in place; tags are joined with `, `. Drawn per sample from its place in the run. "
        "Almost every step then trains on captions never seen before, so SDXL, SD3 and FLUX encode them at every "
        "step instead of caching them (data.cache_text_embeddings is off): the frozen text encoders stay on the "
        "GPU (SDXL about 1.6 GB in bf16, FLUX and SD3 with T5-XXL about 10 GB) and run once per sample.",
    )
    keep_tokens: int = key(
        0, "With data.shuffle_tags: how many leading comma-separated tags stay in place (kohya's `keep_tokens`), "
        "e.g. 1 keeps a trigger tag first.")
    control_path: str = key(
        "",
        "Paired (instruction-edit) training: a folder holding each training image's control (source) image, "
        "matched by file stem (ai-toolkit's `control_path`, musubi-tuner's `control_directory`): the control of "
        "`sub/cat.jpg` is `<folder>/sub/cat.<ext>` or `<folder>/cat.<ext>` (any image extension), every training "
        "and held-out image needing one. The model learns to turn the control into the target as its caption "
        "instructs. Each control gets its target's bucket, crop and flip, and its latents are cached like the "
        "targets'; samples edit the control of the first training image. Only the families that take a control "
        "image (flux_kontext; qwenimage_edit, whose text encoder also reads the control, so it refuses flips); "
        "empty: no control images.",
    )
    masks: str = key(
        "",
        "Masked loss (kohya's `masked_loss`): weight each image's loss by a mask, shrunk to the latent's size and "
        "given the image's crop and flip, so that what lies outside the mask contributes nothing. `alpha`: the "
        "image's own alpha channel (opaque: trained; an image without one trains whole); a folder: a greyscale "
        "mask of the image's size with its name (white: trained, black: ignored; `masks/sub/cat.png` for "
        "`sub/cat.jpg`, or `masks/cat.png`), every image needing one; empty: no masks. Per sample the loss is the "
        "mean of mask x error over the latent, so a half-masked image weighs half. Applies to held-out images too; "
        "prior-preservation class images are never masked.",
    )
