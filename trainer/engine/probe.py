"""What the GPUs of this machine offer, asked of torch: `python -m trainer.engine.probe` prints it as JSON for a
torch-free caller (trainer.core.hardware.probe_in_subprocess)."""

from __future__ import annotations

import sys

from trainer.core.hardware import Hardware, _importable


def probe() -> Hardware:
    import os

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names, memory = [], []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        names.append(props.name)
        memory.append(round(props.total_memory / 2**30, 1))
    capability = [torch.cuda.get_device_capability(i) for i in range(count)]
    bf16 = count > 0 and all(major >= 8 for major, _ in capability)
    return Hardware(
        gpu_count=count,
        gpu_names=tuple(names),
        gpu_memory_gb=tuple(memory),
        bf16=bf16,
        gpu_capability=tuple(major + minor / 10 for major, minor in capability),
        xformers=count > 0 and _importable("xformers.ops"),
        bitsandbytes=count > 0 and _importable("bitsandbytes"),
        cpu_count=os.cpu_count() or 1,
    )


if __name__ == "__main__":
    sys.stdout.write(probe().to_json() + "\n")
