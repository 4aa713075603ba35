"""Upper bounds on the values that size a run, and the numbers no setting can hold (issue 29).

Without them an exposed UI accepted `train.steps: 1e12`, `data.resolution: 100000`, `batch.total: 1e9`,
`sample.images_per_prompt: 1e8`: runs that grew to gigabytes before they were killed. Each bound is far above
any real run (so a real preset never meets one) and says why it is where it is. Separately, an integer past
64 bits or a float that is not finite (YAML's `1e400` is inf) is a per-key problem here: passed on, the first
broke the UI's event stream and the second its number widget. Returns problems, raises nothing.
"""

from __future__ import annotations

import math
from typing import Any

INT64_MAX = 2**63 - 1

# key -> (largest accepted value, why: the end of the message)
UPPER_BOUNDS: dict[str, tuple[int, str]] = {
    "train.steps": (10_000_000, "ten million steps is months of training on the fastest GPU"),
    "data.resolution": (4096, "no supported family trains above 4096 px (FLUX and SD3 stop at about 2048)"),
    "sample.size": (4096, "no supported family samples above 4096 px"),
    "sample.width": (4096, "no supported family samples above 4096 px"),
    "sample.height": (4096, "no supported family samples above 4096 px"),
    "data.bucket_max_side": (4096, "no supported family trains above 4096 px"),
    "batch.total": (65_536, "no memory holds such a batch, and accumulated it takes days per step"),
    "batch.per_device": (1024, "no GPU memory holds more images per device"),
    "sample.images_per_prompt": (64, "each sample event writes every image; more is a disk-filler, not a preview"),
    "sample.steps": (1000, "denoising samplers use 20-50 steps"),
    "prior.num_class_images": (100_000, "prior preservation uses a few hundred class images"),
    "prior.sample_steps": (1000, "denoising samplers use 20-50 steps"),
    "lora.rank": (1024, "a LoRA rank above 1024 is larger than most layers it adapts"),
    "checkpoint.keep": (1000, "each checkpoint is a full copy of the trained weights"),
    "detection.eval_images": (1_000_000, "no evaluation set is larger"),
    "detection.sample_images": (64, "each sample event draws every image"),
    "detection.max_detections": (10_000, "no image holds more objects worth drawing"),
}


def number_problem(key: str, value: Any) -> str | None:
    """A value no number setting can hold: an integer past 64 bits, a float that is not finite (looked for inside
    lists and mappings too: data.datasets' entries, train.betas)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return next((q for v in value if (q := number_problem(key, v))), None)
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) > INT64_MAX:
        return (f"{key}: {str(value)[:24]}{'...' if len(str(value)) > 24 else ''} is too large for a number "
                f"setting (at most {INT64_MAX}); type a realistic value")
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: {value} is not a finite number (1e400 reads as infinity); type a realistic value"
    return None


def bound_problems(config) -> list[str]:
    """`key: ...` for every size-setting value above its bound."""
    problems = []
    for key, (most, why) in UPPER_BOUNDS.items():
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            problems.append(f"{key}: {value} is more than this trainer accepts ({most}): {why}; lower it")
    return problems
