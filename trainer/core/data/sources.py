"""The run's image folders with every setting resolved: `data.datasets` entries over the `data.*` defaults, or
`data.path` alone as one folder. Torch-free (the launcher's data check and the UI read it too).

Each folder's images are scanned as `data.path`'s always were (trainer.core.data.scan) and tagged with their
folder's index (`ImageItem.dataset`), so that per-image settings (resolution, flip, caption augmentation) are a
look-up of `sources[item.dataset]`. Regularization folders are scanned apart: they are the prior-preservation
images of the run, never part of an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.core.data.buckets import BucketSpec, assign_buckets
from trainer.core.data.captions import CaptionAugment
from trainer.core.data.scan import DatasetScan, ImageItem, require_usable, scan_dataset

Size = tuple[int, int]


@dataclass(frozen=True)
class Source:
    """One image folder of the run."""

    key: str  # the config key to name in messages: `data.path` or `data.datasets[i].path`
    path: str
    repeats: int
    resolution: int
    flip: bool
    instance_prompt: str | None
    caption_extension: str
    augment: CaptionAugment
    regularization: bool = False


def sources(data) -> list[Source]:
    """Every folder of the config's data section, in order (their index is `ImageItem.dataset`)."""
    if not data.datasets:
        return [Source("data.path", data.path, 1, data.resolution, data.flip, data.instance_prompt,
                       data.caption_extension, CaptionAugment.from_config(data))]

    def pick(entry, name):
        value = getattr(entry, name)
        return getattr(data, name) if value is None else value

    out = []
    for i, entry in enumerate(data.datasets):
        augment = CaptionAugment(prefix=str(pick(entry, "caption_prefix")).strip(),
                                 dropout=float(pick(entry, "caption_dropout")),
                                 shuffle=bool(pick(entry, "shuffle_tags")), keep_tokens=int(pick(entry, "keep_tokens")))
        out.append(Source(f"data.datasets[{i}].path", entry.path, int(entry.repeats), int(pick(entry, "resolution")),
                          bool(pick(entry, "flip")), pick(entry, "instance_prompt"), pick(entry, "caption_extension"),
                          augment, bool(entry.is_regularization)))
    return out


def scan_sources(data, *, check_resolution: bool) -> DatasetScan:
    """The training folders' scan, with the regularization folders' images in its `regularization`: each folder
    scanned and required usable, its images tagged with its index and their repeats multiplied by its own. The
    scan's `root` is the first training folder's, `roots` every training folder's; with several folders each
    warning names its folder."""
    training: DatasetScan | None = None
    regularization: list[ImageItem] = []
    warnings: list[str] = []
    folders = sources(data)
    several = len(folders) > 1
    for index, source in enumerate(folders):
        scan = scan_dataset(source.path, instance_prompt=source.instance_prompt,
                            caption_extension=source.caption_extension,
                            resolution=source.resolution if check_resolution else None)
        require_usable(scan, key=source.key)
        items = [replace(item, dataset=index, repeats=item.repeats * source.repeats) for item in scan.items]
        warnings += [f"{source.path}: {w}" if several else w for w in scan.warnings]
        if source.regularization:
            regularization += items
        elif training is None:
            training = replace(scan, items=items, roots=[scan.root])
        else:
            training.items.extend(items)
            training.folders.update(scan.folders)
            training.roots.append(scan.root)
    assert training is not None, "validation requires a training folder"  # trainer.core.config.validate
    return replace(training, warnings=warnings, regularization=regularization)


def image_targets(items: list[ImageItem], data, family_buckets: bool) -> list[Size]:
    """The (width, height) each image trains at: the square of its folder's resolution, or with data.bucketing
    (where the family buckets) the bucket nearest its aspect ratio among its resolution's buckets."""
    per_source = sources(data)
    if not (data.bucketing and family_buckets):
        return [(per_source[i.dataset].resolution, per_source[i.dataset].resolution) for i in items]
    targets: list[Size] = [(0, 0)] * len(items)
    for resolution in sorted({per_source[i.dataset].resolution for i in items}):
        spec = replace(BucketSpec.from_config(data), resolution=resolution)
        members = [n for n, i in enumerate(items) if per_source[i.dataset].resolution == resolution]
        buckets, chosen = assign_buckets([(items[n].width, items[n].height) for n in members], spec)
        for n, b in zip(members, chosen):
            targets[n] = buckets[b]
    return targets


def shape_groups(targets: list[Size]) -> tuple[list[Size], list[int]]:
    """(the distinct shapes, sorted by aspect ratio then width; each image's index into them)."""
    shapes = sorted(set(targets), key=lambda s: (s[0] / s[1], s[0]))
    where = {s: i for i, s in enumerate(shapes)}
    return shapes, [where[t] for t in targets]
