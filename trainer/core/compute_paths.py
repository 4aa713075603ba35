"""Which compute paths a run takes on this machine, for the plan (trainer.core.plan): the fp8 matmul of
`model.fp8_compute` and the channels-last UNet of `train.channels_last`. Torch-free: pure functions of the
config, the hardware description and the plan's device."""

from __future__ import annotations

from trainer.core.config.schema import Config
from trainer.core.hardware import Hardware
from trainer.core.registry import spec_of

FP8_MATMUL_CAPABILITY = 8.9  # Ada (RTX 40xx, L4, L40); Hopper is 9.0, Blackwell 10.0 / 12.0
_STORED_ONLY = "the fp8 base weights are stored in float8 and upcast for each layer (saves memory, not time)"


def fp8_compute(config: Config, hw: Hardware, device: str,
                gpu_ids: tuple[int, ...]) -> tuple[bool, list[str], list[str]]:
    """(whether the frozen Linear layers multiply in fp8, notes, problems). Only with model.base_weights=fp8;
    `auto` takes it where every GPU of the run has fp8 tensor cores, never on the CPU (torch's CPU fp8 matmul is
    a slow reference implementation, there for `on` and the tests)."""
    wanted = config.model.fp8_compute
    if config.model.base_weights != "fp8" or wanted == "off":
        return False, [], []  # fp8_compute=on without base_weights=fp8 is refused by the config's validation
    if device == "cpu":
        if wanted == "on":
            return True, ["model.fp8_compute on: the CPU runs torch's reference fp8 matmul (for tests; slower than "
                          "fp32)"], []
        return False, [f"model.fp8_compute auto: on the CPU {_STORED_ONLY}; model.fp8_compute=on runs torch's "
                       "CPU fp8 matmul, for tests"], []
    known = [hw.gpu_capability[i] for i in gpu_ids if i < len(hw.gpu_capability)]
    if len(known) < len(gpu_ids):
        why = "the GPUs' compute capability is unknown here (an old hardware probe)"
    elif min(known) < FP8_MATMUL_CAPABILITY:
        why = (f"a GPU of this run has compute capability {min(known):.1f} and fp8 matmuls need "
               f"{FP8_MATMUL_CAPABILITY} or newer (Ada, Hopper, Blackwell)")
    else:
        return True, [], []
    if wanted == "on":
        return False, [], [f"model.fp8_compute: on cannot run here: {why}; set model.fp8_compute=auto (fp8 "
                           "storage only) or off"]
    return False, [f"model.fp8_compute auto: {_STORED_ONLY}, because {why}"], []


def channels_last(config: Config, device: str) -> bool:
    """Whether the UNet (and VAE) of this run are stored channels-last: `auto` on CUDA for LoRA runs of the UNet
    families (`on` elsewhere is refused by the config's validation)."""
    wanted = config.train.channels_last
    if wanted != "auto":
        return wanted == "on"
    return device == "cuda" and config.method == "lora" and spec_of(config.model.family).channels_last
