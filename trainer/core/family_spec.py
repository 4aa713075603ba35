"""What the torch-free side needs to know about a model family, as data: `FamilySpec`.

The core (config checks, plan, model size, resume, run folder, demo assets) and the web UI read a family's spec
instead of comparing family names, so adding a family is its folder (a spec, an implementation of
`trainer.families.protocol.Family`, a demo builder), its presets and tests, and one line in the registry
(`trainer/families/__init__.py`). A spec imports no torch: the UI process reads it too.

The contract lives in core and the families import it (never the reverse): core looks specs up in
`trainer.core.registry`, which the families fill.

Callables are named as "module:function" strings and imported only when used, so reading a spec never pulls
in a family's torch-side code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.core.memory import ModelSizes

# Keys every family's checkpoints depend on: changing one on resume would load state into a different model,
# optimizer or data order (or, for batch.total, silently change what a step means).
COMMON_FROZEN_ON_RESUME = (
    "name", "model.family", "model.path", "model.config", "model.revision", "model.variant", "method", "seed",
    "batch.total", "data.path", "train.optimizer",
)
# The diffusion families' keys that name local files or folders (model.path may also be a hub id or demo://).
DIFFUSION_PATH_KEYS = ("model.path", "model.config", "data.path", "data.val_path", "prior.class_path", "data.masks",
                       "lora.init_from")
# What the flow-matching families (trainer/families/flow/) share: a training adapter's file is also a path (or
# owner/repo/file on the hub), which layers carry LoRA decides the adapter's tensors, and the `flow:` section's
# one title in the UI.
FLOW_PATH_KEYS = DIFFUSION_PATH_KEYS + ("flow.training_adapter",)
FLOW_SECTION_TITLE = "Flow matching (the transformer families)"
DIFFUSION_PATH_EXCEPTIONS = {"data.masks": ("alpha",)}  # the images' own alpha channel, not a folder


def load_object(ref: str) -> Any:
    """The object a "package.module:name" reference names (imports the module)."""
    module_name, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@dataclass(frozen=True)
class FamilySpec:
    """A model family, as the torch-free side sees it. Every field is documentation a maintainer reads."""

    name: str
    """The `model.family` value."""
    title: str
    """How the UI names it, e.g. "Stable Diffusion 1.x / 2.x"."""
    implementation: str
    """"module:Class" of the `Family` the worker trains (imported only in the worker: it needs torch)."""
    methods: tuple[str, ...] = ("lora", "full")
    """The `method` values it trains; others are refused by validation with the reason in `method_note`."""
    method_note: str = ""
    """Why other methods are refused, with the fix (the `method` error says it)."""
    sharding: tuple[str, ...] = ("ddp", "fsdp", "deepspeed")
    """The `distributed.sharding` values it supports (`auto` is always accepted)."""
    sharding_note: str = ""
    """Why a sharding is missing, said when a preset asks for it."""
    section: str | None = None
    """The config section only this family reads (`flow`, `detection`): its UI panel opens for this family."""
    section_title: str = ""
    checks: str | None = None
    """"module:function" (torch-free) `(config, check_paths) -> list[str]`: the family's own config problems."""
    data_check: str = "trainer.core.family_spec:check_captioned_images"
    """"module:function" (torch-free) `(config) -> scan`, run by the launcher before any process starts; raises
    UserError when the dataset cannot train at all. The scan may carry `items` for the plan's bucket list."""
    dataset_paths: str | None = None
    """"module:function" (torch-free) `(config) -> iterable of (key, path)`: every file or folder the dataset's
    descriptor files point to (a YOLO data.yaml, a COCO json), which an exposed UI confines like the path keys."""
    xformers: bool = True
    """`attention: xformers` applies to its network; False: the plan says `sdpa` with a note instead."""
    hub_upload_note: str = ""
    """Why `output.push_to_hub` is refused for it, with the fix; empty: its outputs and a diffusers model card are
    uploaded (trainer.core.hub)."""
    channels_last: bool = False
    """Its trained network is a UNet of convolutions, which `train.channels_last` stores channels-last on CUDA."""
    resolution_multiple: int | None = 8
    """`data.resolution` must be a multiple of this (the VAE's downsampling); None: the family checks it."""
    bucket_multiple: int | None = 8
    """Aspect-ratio bucket sides must be multiples of this; None: the family has no buckets."""
    trained_component: str | None = None
    """The sub-folder of a diffusers model holding the network a full fine-tune trains (`unet`, `transformer`),
    measured for the FSDP choice; None: no automatic FSDP."""
    published_parameters: float | None = None
    """The trained network's size when the model cannot be measured (a hub id)."""
    published_variants: dict[str, float] = field(default_factory=dict)
    """Sizes of named variants: a model path containing the key (`large`) gets that size."""
    block_lists: tuple[str, ...] = ()
    """The trained network's attributes holding its repeated blocks (ModuleLists), in forward order: `model.block_swap`
    keeps the last of them in CPU memory (trainer.families.components.block_swap). Empty: block swap is refused
    with `block_swap_note`."""
    block_swap_note: str = ""
    """Why block swap is refused for it, with what to do instead."""
    path_help: str = ""
    """What `model.path` names for this family when it is not a diffusers model, appended to that key's help
    (detection: its architectures); empty: nothing to add."""
    quantizes_text_encoders: bool = False
    """Its trainer stores the frozen text encoders as `model.text_encoder_weights` says and encodes where
    `model.text_encoder_device` says; False: other values are refused."""
    sizes: ModelSizes | None = None
    """Its base model's published sizes, for the plan's memory estimate (trainer.core.memory); None: no estimate."""
    sizes_variants: dict[str, ModelSizes] = field(default_factory=dict)
    """Sizes of named variants, matched in model.path as `published_variants` are."""

    def sizes_for(self, model_path: str) -> ModelSizes | None:
        for variant, sizes in self.sizes_variants.items():
            if variant in model_path.lower():
                return sizes
        return self.sizes
    frozen_on_resume: tuple[str, ...] = ()
    """This family's keys that may not change on resume (besides COMMON_FROZEN_ON_RESUME), with why in a comment
    where they are declared."""
    path_keys: tuple[str, ...] = DIFFUSION_PATH_KEYS
    """Config keys naming local files or folders: made absolute in the run's config, confined in an exposed UI."""
    path_exceptions: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DIFFUSION_PATH_EXCEPTIONS))
    """Values of a path key that are not paths (detection.weights: `coco`, `none`)."""
    exports: tuple[str, ...] = ()
    """What output/ holds after a run, for the README and the UI."""
    demo_assets: dict[str, str] = field(default_factory=dict)
    """`demo://NAME` -> "module:function" building it once under a root folder and returning {name: path}."""
    control_images: str = ""
    """How the family reads `data.control_path` (paired instruction-edit training: the control image the model
    edits), for the UI and the plan; empty: it takes no control image, and data.control_path is refused."""
    generates: bool = True
    """It draws images from a prompt (the Runs tab's Generate panel); False: its samples are predictions."""
    demo_preset: str = ""
    """The shipped preset (presets/) that trains this family offline on its demo assets, on the CPU, to `done`
    with samples and outputs that load; every family has one (tests/test_demo_presets.py runs them all)."""

    def check(self, config, *, check_paths: bool = True, edit_families: tuple[str, ...] = ()) -> list[str]:
        """This family's config problems (its `checks`, plus methods and sharding it does not support).
        `edit_families`: the registered families that take control images, named where this one does not."""
        problems = []
        if config.method not in self.methods:
            problems.append(f"method: {self.method_note or f'{self.name} trains ' + ' or '.join(self.methods)}"
                            f" (got {config.method})")
        if config.data.control_path and not self.control_images:
            edits = ", ".join(edit_families) or "none registered"
            problems.append(f"data.control_path: {self.name} takes no control image (its model generates from the "
                            "caption alone); paired instruction-edit training is for the families that do "
                            f"({edits}): set model.family to one of them, or leave data.control_path empty")
        if config.model.text_encoder_device == "cpu" and not self.quantizes_text_encoders:
            problems.append(f"model.text_encoder_device: cpu is for the flow-matching families; {self.name} encodes "
                            "on the run's device: set model.text_encoder_device=auto")
        elif config.model.text_encoder_device == "cpu" and (config.data.cache_text_embeddings is False
                                                            or config.data.shuffle_tags):
            problems.append("model.text_encoder_device: cpu encodes the captions once, into the text cache, which "
                            "this run turns off (data.cache_text_embeddings: false or data.shuffle_tags): set "
                            "data.cache_text_embeddings=true and data.shuffle_tags=false, or "
                            "model.text_encoder_device=auto")
        if config.model.text_encoder_weights != "bf16" and not self.quantizes_text_encoders:
            problems.append(f"model.text_encoder_weights: {config.model.text_encoder_weights} is for the "
                            f"flow-matching families; {self.name} keeps its text encoders unquantized (they are "
                            "small beside its network): set model.text_encoder_weights=bf16")
        if self.checks:
            problems += load_object(self.checks)(config, check_paths=check_paths)
        return problems

    def block_swap_problem(self, config) -> str | None:
        """Why `model.block_swap` cannot run for this config, with the fix; None when it can (or is 0)."""
        swap = config.model.block_swap
        if swap == 0:
            return None
        key = f"model.block_swap: {swap}"
        if not self.block_lists:
            return f"{key} is not available for {self.name}: {self.block_swap_note or 'it has no repeated blocks'}"
        if not config.train.gradient_checkpointing:
            return (f"{key} needs train.gradient_checkpointing=true: without it the backward keeps every block's "
                    "weights on the GPU and nothing is saved; set it, or model.block_swap=0")
        if config.distributed.sharding in ("fsdp", "deepspeed"):
            return (f"{key} runs under DDP: FSDP and DeepSpeed split the same weights (and a full fine-tune's "
                    "optimizer state) across the GPUs their own way, and would gather the CPU-held blocks back; "
                    "set distributed.sharding=ddp (one GPU, or each GPU swapping), or model.block_swap=0")
        if config.model.fp8_compute != "off" and config.model.base_weights == "fp8":
            return (f"{key} copies the stored weights; the fp8 matmul's scaled layers are not written for that yet: "
                    "set model.fp8_compute=off (fp8 storage still halves the weights), or model.block_swap=0")
        if config.train.compile:
            return f"{key} swaps weights into each block at its call, which torch.compile does not follow: set " \
                   "train.compile=off, or model.block_swap=0"
        return None

    def sharding_problem(self, sharding: str) -> str | None:
        if sharding in self.sharding or sharding in ("auto", "ddp"):
            return None
        return (f"distributed.sharding: {sharding} is not available for {self.name}"
                + (f": {self.sharding_note}" if self.sharding_note else ""))

    def is_path(self, key: str, value) -> bool:
        """Whether `value` of `key` names a local file or folder (not a hub id, demo asset or keyword)."""
        return key in self.path_keys and bool(value) and value not in self.path_exceptions.get(key, ())

    def run_data_check(self, config):
        check: Callable = load_object(self.data_check)
        return check(config)


def check_captioned_images(config):
    """The diffusion families' data check: a folder of images with captions (trainer.core.data.scan), less the
    images held out for the validation loss (trainer.core.data.holdout), each with its loss mask when data.masks
    names a folder (trainer.core.data.masks), and its control image with data.control_path
    (trainer.core.data.controls). Returns the training part of the scan (the launcher lists its
    aspect-ratio buckets and the held-out count in the plan)."""
    from trainer.core.data.holdout import training_scan
    from trainer.core.data.controls import check_controls
    from trainer.core.data.masks import check_masks

    scan = training_scan(config, resolution=config.data.resolution)
    check_masks(config, scan)
    check_controls(config, scan)
    return scan


# The diffusion families' keys a resume may not change.
# Adapter and trained-part keys shape the checkpoint's tensors; prior.enabled and data.val_split change what a
# step trains on; data.val_path is what val_loss (and so checkpoints/best/) has been measured on.
DIFFUSION_FROZEN_ON_RESUME = (
    "lora.rank", "lora.unet_targets", "lora.train_text_encoder", "lora.text_encoder_targets", "lora.type",
    "lora.factor", "lora.dora", "lora.ema",
    "full.train_text_encoder", "full.ema", "prior.enabled", "data.val_split", "data.val_path",
)
FLOW_FROZEN_ON_RESUME = DIFFUSION_FROZEN_ON_RESUME + ("flow.lora_targets", "flow.lora_blocks", "flow.training_adapter")
