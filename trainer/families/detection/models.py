"""torchvision detectors for the detection family: built for K classes from COCO weights, a local file or random
initialisation, with frozen BatchNorm and frozen early stages for pretrained backbones, and a tiny FCOS (four
stride-2 convolutions) for the offline demo.

    model, info = build_detector("fasterrcnn_resnet50_fpn_v2", num_classes=3, weights="coco", resolution=800)

Labels are 1..K; torchvision's detectors keep 0 for the background, so they are built with K + 1 classes. The
classification head of pretrained weights (91 COCO classes) does not fit and keeps its fresh initialisation:
that is the head replacement. Faster R-CNN's random anchor/proposal sampling draws from per-image generators
(`seed_samplers`), so it depends on the sample, not on how the batch was split across processes.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler
from torchvision.ops.misc import FrozenBatchNorm2d

from trainer.errors import UserError
from trainer.families.detection.architectures import ARCHITECTURES

DEFAULT_TRAINABLE_LAYERS = 3  # torchvision's default for ResNet and MobileNet FPN backbones
BACKBONE_PREFIX = "backbone.body."  # the classification CNN, without the FPN (detection.backbone_lr_scale)


# ----------------------------------------------------------------------------------------------------------------
# The demo's tiny FCOS


class TinyBackbone(nn.Module):
    """Four stride-2 conv-BN-ReLU blocks; FCOS reads the last two (strides 8 and 16)."""

    def __init__(self, width: int = 32, out_channels: int = 64):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.c1, self.c2 = block(3, width // 2), block(width // 2, width)
        self.c3, self.c4 = block(width, out_channels), block(out_channels, out_channels)
        self.out_channels = out_channels

    def forward(self, x):
        p3 = self.c3(self.c2(self.c1(x)))
        return OrderedDict([("0", p3), ("1", self.c4(p3))])


def fcos_tiny(num_classes: int, **kwargs):
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.fcos import FCOSHead

    backbone = TinyBackbone()
    anchors = AnchorGenerator(sizes=((8,), (16,)), aspect_ratios=((1.0,),) * 2)
    head = FCOSHead(backbone.out_channels, 1, num_classes, num_convs=2)
    return FCOS(backbone, num_classes, anchor_generator=anchors, head=head, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Building


def _construct(arch: str, num_classes: int, resolution: int) -> nn.Module:
    import torchvision

    if ARCHITECTURES[arch].backbone == "tiny":
        return fcos_tiny(num_classes, min_size=resolution, max_size=resolution)
    if ARCHITECTURES[arch].fixed_square:
        # the builder fixes 320x320 and passes extra keyword arguments on to MobileNet: set the size afterwards
        model = torchvision.models.get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes)
        model.transform.min_size, model.transform.max_size = (resolution,), resolution
        model.transform.fixed_size = (resolution, resolution)
        return model
    return torchvision.models.get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes,
                                        min_size=resolution, max_size=resolution)


def read_weights(arch: str, weights: str) -> dict[str, torch.Tensor]:
    """The state dict of `weights`: `coco` (torchvision's DEFAULT, downloaded once) or a local file."""
    if weights == "coco":
        import torchvision

        enum = torchvision.models.get_model_weights(arch).DEFAULT
        try:
            return enum.get_state_dict(progress=False, check_hash=True)
        except Exception as exc:
            raise UserError(
                f"detection.weights=coco: could not get torchvision's COCO weights for {arch} from {enum.url} "
                f"({type(exc).__name__}: {exc}). Without network, download that file elsewhere, copy it here and "
                "set detection.weights=/path/to/it.pth (or train from scratch with detection.weights=none).") from None
    path = Path(weights).expanduser()
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            if meta.get("architecture") and meta["architecture"] != arch:
                raise UserError(f"detection.weights: {path} holds a {meta['architecture']} detector, not {arch}; "
                                f"set model.path={meta['architecture']} or use other weights")
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"detection.weights: cannot read {path} ({type(exc).__name__}: {exc}); give a torchvision "
                        ".pth state dict or a .safetensors file") from None
    for wrapper in ("model", "state_dict"):  # torchvision reference / lightning checkpoints
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise UserError(f"detection.weights: {path} does not hold a state dict")
    return {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_matching(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> list[str]:
    """Load every tensor of `state` whose name and shape fit; return the names left at their initialisation
    (the class-dependent head). Raises UserError when the weights are for another architecture."""
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    left = [k for k in own if k not in usable and not k.endswith("num_batches_tracked")]
    head = [k for k in left if k in state]  # present but shaped for other classes
    foreign = [k for k in left if k not in state]
    if not usable or len(foreign) > 0.05 * len(own):
        raise UserError(f"detection.weights: {source} does not fit this architecture ({len(foreign)} of {len(own)} "
                        f"tensors missing, e.g. {foreign[:3]}); is it a checkpoint of another detector?")
    model.load_state_dict(usable, strict=False)
    return head + foreign


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm2d below `module` by FrozenBatchNorm2d with the same statistics (in place)."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            with torch.no_grad():
                frozen.weight.copy_(child.weight)
                frozen.bias.copy_(child.bias)
                frozen.running_mean.copy_(child.running_mean)
                frozen.running_var.copy_(child.running_var)
            setattr(module, name, frozen)
        else:
            freeze_batchnorm(child)
    return module


def freeze_stages(model: nn.Module, arch: str, trainable: int | None) -> None:
    """Freeze all but the top `trainable` backbone stages, as torchvision does for pretrained backbones."""
    trainable = DEFAULT_TRAINABLE_LAYERS if trainable is None else trainable
    backbone = ARCHITECTURES[arch].backbone
    if backbone == "resnet50":
        keep = ["layer4", "layer3", "layer2", "layer1", "conv1"][:trainable] + (["bn1"] if trainable == 5 else [])
        for name, p in model.get_submodule("backbone.body").named_parameters():
            if not any(name.startswith(k) for k in keep):
                p.requires_grad_(False)
    elif backbone == "mobilenet_v3" and ARCHITECTURES[arch].max_trainable_layers:
        blocks = list(model.get_submodule("backbone.body").children())
        stages = [0] + [i for i, b in enumerate(blocks) if getattr(b, "_is_cn", False)] + [len(blocks) - 1]
        first_trained = len(blocks) if trainable == 0 else stages[len(stages) - trainable]
        for block in blocks[:first_trained]:
            block.requires_grad_(False)


def build_detector(arch: str, num_classes: int, *, weights: str = "none", resolution: int = 800,
                   trainable_backbone_layers: int | None = None, max_detections: int = 100,
                   frozen_bn: bool | None = None, class_names: list[str] | None = None,
                   saved: dict[str, str] | None = None) -> tuple[nn.Module, dict]:
    """A detector for labels 1..num_classes; `info` says what was loaded and what is frozen.

    `frozen_bn` (default: whether weights are pretrained) turns the backbone's BatchNorm into FrozenBatchNorm2d;
    `load_detector` passes it to rebuild a saved model's exact structure (the common metadata is all a
    torchvision detector needs: `class_names` and `saved` are for the interface, detectors.Implementation)."""
    model = _construct(arch, num_classes + 1, resolution)
    info: dict = {"architecture": arch, "weights": weights, "fresh": []}
    if weights != "none":
        info["fresh"] = load_matching(model, read_weights(arch, weights), weights)
        if frozen_bn is not False:
            freeze_batchnorm(model.get_submodule("backbone"))
        freeze_stages(model, arch, trainable_backbone_layers)
    elif frozen_bn:
        freeze_batchnorm(model.get_submodule("backbone"))
    info["frozen_bn"] = bool(frozen_bn if frozen_bn is not None else weights != "none")
    set_caps(model, max_detections)
    for owner in (getattr(model, "rpn", None), getattr(model, "roi_heads", None)):
        if owner is not None:
            old = owner.fg_bg_sampler
            owner.fg_bg_sampler = SeededSampler(old.batch_size_per_image, old.positive_fraction)
    info["trainable_bn"] = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    info["metadata"] = {}
    return model, info


def set_caps(model: nn.Module, max_detections: int) -> None:
    """At most `max_detections` boxes per image, from at most 10x as many candidates per feature level."""
    # The caps are ints, which nn.Module's __getattr__/__setattr__ hints (tensors and submodules only) do not allow.
    if hasattr(model, "roi_heads"):
        model.get_submodule("roi_heads").detections_per_img = max_detections  # type: ignore[assignment]
    else:
        model.detections_per_img = max_detections  # type: ignore[assignment]
        model.topk_candidates = min(  # type: ignore[assignment]
            model.topk_candidates, max(10 * max_detections, 100))  # type: ignore[type-var]


# ----------------------------------------------------------------------------------------------------------------
# Sampling that depends on the sample, not on the batch


class SeededSampler(BalancedPositiveNegativeSampler):
    """torchvision's positive/negative sampler drawing image i's choice from `generators[i]` (seeded by the
    sample's stream position), so Faster R-CNN trains on the same anchors and proposals whichever process and
    micro-batch an image lands in. Without generators (inference) it is torchvision's own."""

    generators: list[torch.Generator] | None = None

    def __call__(self, matched_idxs):
        if not self.generators or len(self.generators) != len(matched_idxs):
            return super().__call__(matched_idxs)
        pos_idx, neg_idx = [], []
        for matched, gen in zip(matched_idxs, self.generators):
            positive = torch.where(matched >= 1)[0]
            negative = torch.where(matched == 0)[0]
            num_pos = min(positive.numel(), int(self.batch_size_per_image * self.positive_fraction))
            num_neg = min(negative.numel(), self.batch_size_per_image - num_pos)
            pos = positive[torch.randperm(positive.numel(), generator=gen)[:num_pos].to(positive.device)]
            neg = negative[torch.randperm(negative.numel(), generator=gen)[:num_neg].to(negative.device)]
            pos_mask = torch.zeros_like(matched, dtype=torch.uint8)
            neg_mask = torch.zeros_like(matched, dtype=torch.uint8)
            pos_mask[pos] = 1
            neg_mask[neg] = 1
            pos_idx.append(pos_mask)
            neg_idx.append(neg_mask)
        return pos_idx, neg_idx


@contextmanager
def seeded(model: nn.Module, seeds: list[int]):
    """Faster R-CNN's samplers draw from the samples' seeds during this forward (the others draw nothing)."""
    seed_samplers(model, seeds)
    try:
        yield
    finally:
        seed_samplers(model, None)


def seed_samplers(model: nn.Module, seeds: list[int] | None) -> None:
    """Give Faster R-CNN's samplers one generator per image of the next forward (None: unseeded)."""
    for k, owner in enumerate((getattr(model, "rpn", None), getattr(model, "roi_heads", None))):
        if owner is not None and isinstance(owner.fg_bg_sampler, SeededSampler):
            owner.fg_bg_sampler.generators = (
                None if seeds is None else [torch.Generator().manual_seed((s + k) % 2**63) for s in seeds])
