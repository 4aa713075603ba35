"""What the machine offers: GPUs, their compute capability, bf16, xformers, bitsandbytes. `Hardware` itself is torch-free.

Probing imports torch, so it lives on the engine side (trainer.engine.probe); the launcher and the web UI run
`python -m trainer.engine.probe` (`probe_in_subprocess`) and read the JSON it prints.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Hardware:
    gpu_count: int = 0
    gpu_names: tuple[str, ...] = ()
    gpu_memory_gb: tuple[float, ...] = ()
    bf16: bool = False  # every visible GPU supports bf16
    # CUDA compute capability of each GPU as major.minor (8.9 Ada, 9.0 Hopper): fp8 matmuls need 8.9+. Empty when
    # unknown (a probe from before it was recorded): nothing that needs it is chosen then.
    gpu_capability: tuple[float, ...] = ()
    xformers: bool = False  # importable (and so usable with this torch)
    bitsandbytes: bool = False
    cpu_count: int = 1
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Hardware":
        data = json.loads(text)
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)


CPU_ONLY = Hardware()


def _importable(name: str) -> bool:
    try:
        if importlib.util.find_spec(name) is None:  # raises for "pkg.mod" when pkg itself is missing
            return False
        importlib.import_module(name)
        return True
    except Exception:  # a wheel built for another torch fails at import: treat it as absent
        return False


def probe_in_subprocess(timeout_s: float = 180) -> Hardware:
    """trainer.engine.probe in a child process, so the caller (the web UI, launch.py) never imports torch or
    touches CUDA."""
    import os
    import subprocess
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "trainer.engine.probe"], capture_output=True, text=True,
                            timeout=timeout_s, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"probing the GPUs failed: {result.stderr.strip()[-500:]}")
    return Hardware.from_json(result.stdout.strip().splitlines()[-1])
