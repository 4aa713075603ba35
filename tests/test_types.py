"""The type check CI runs: mypy over trainer/ and app/ with the configuration in pyproject.toml ([tool.mypy])."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 20-25 s without a cache on 2 cores: mypy reads torch (not diffusers or transformers)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[test]' installs it)")
def test_mypy_passes():
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")],
                            cwd=REPO, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
