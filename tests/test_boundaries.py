"""The UI process must never import torch (DESIGN.md): what it uses of `trainer` stays torch-free."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_FREE = ["trainer.core.config", "trainer.core.plan", "trainer.core.events", "trainer.core.launcher", "trainer.core.resume",
              "trainer.core.runfolder", "trainer.core.data.scan", "trainer.core.hardware", "trainer.core.checkpoint"]


def test_launcher_side_modules_do_not_import_torch():
    code = ("import sys; import " + ", ".join(TORCH_FREE) +
            "; heavy = [m for m in ('torch', 'diffusers', 'transformers', 'gradio') if m in sys.modules]; "
            "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
