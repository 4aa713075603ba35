"""What the machine offers: GPUs, bf16, xformers, bitsandbytes. `Hardware` itself is torch-free.

`probe()` imports torch; a process that must not (the web UI) runs `python -m trainer.core.hardware` and reads the
JSON it prints.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Hardware:
    gpu_count: int = 0
    gpu_names: tuple[str, ...] = ()
    gpu_memory_gb: tuple[float, ...] = ()
    bf16: bool = False  # every visible GPU supports bf16
    xformers: bool = False  # importable (and so usable with this torch)
    bitsandbytes: bool = False
    cpu_count: int = 1
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Hardware":
        data = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


CPU_ONLY = Hardware()


def _importable(name: str) -> bool:
    try:
        if importlib.util.find_spec(name) is None:  # raises for "pkg.mod" when pkg itself is missing
            return False
        importlib.import_module(name)
        return True
    except Exception:  # a wheel built for another torch fails at import: treat it as absent
        return False


def probe() -> Hardware:
    import os

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names, memory = [], []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        names.append(props.name)
        memory.append(round(props.total_memory / 2**30, 1))
    bf16 = count > 0 and all(torch.cuda.get_device_capability(i)[0] >= 8 for i in range(count))
    return Hardware(
        gpu_count=count,
        gpu_names=tuple(names),
        gpu_memory_gb=tuple(memory),
        bf16=bf16,
        xformers=count > 0 and _importable("xformers.ops"),
        bitsandbytes=count > 0 and _importable("bitsandbytes"),
        cpu_count=os.cpu_count() or 1,
    )


def probe_in_subprocess(timeout_s: float = 180) -> Hardware:
    """`probe()` in a child process, so the caller (the web UI, launch.py) never imports torch or touches CUDA."""
    import os
    import subprocess
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "trainer.core.hardware"], capture_output=True, text=True,
                            timeout=timeout_s, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"probing the GPUs failed: {result.stderr.strip()[-500:]}")
    return Hardware.from_json(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.stdout.write(probe().to_json() + "\n")
