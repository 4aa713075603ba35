"""Every shipped preset starts: each passes `launch.py --dry-run` once pointed at data (a user's first step), and
each offline preset (`demo://` data) trains to `done` through the launcher: here a step through the real command
line, or in the module that tests its family (TRAINED_ELSEWHERE). A fresh
install (`.ci/run` makes a new virtual environment every run) therefore proves that pyproject.toml declares every
package the presets need. The optional extras a preset's keys pull in are checked against pyproject here and
against the Docker image in test_docker.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import launch
from trainer.core import hardware
from trainer.engine.probe import probe
from trainer.core.config import load_config
from trainer.core.config.extras import EXTRAS, extras_needed
from trainer.core.config.validate import DEMO_SCHEME
from trainer.core.events import read_events
from tests.test_demo_presets import PIPELINES as DEMO_PIPELINES
from trainer.families import SPECS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "presets").glob("*.yaml"))
# The offline presets: their data (and a diffusion demo's base model) are `demo://` assets the registry builds; a
# detection demo's model is a tiny architecture from random init. A preset that another module trains through the
# launcher (the preset file as shipped, at most its model or data pointed at that module's tiny fixtures) is not
# started a second time here: that run imports and runs everything this one would. Each start costs a worker's
# imports and a tiny model's build (15-30 s on 2 cores), which is why the suite does it once per preset.
TRAINED_IN_DEMO_PRESETS = {SPECS[family].demo_preset for family in DEMO_PIPELINES}  # with samples, LoRA loaded
TRAINED_ELSEWHERE = {
    "demo-chroma.yaml": "test_chroma.py", "demo-zimage.yaml": "test_zimage.py",
    "demo-qwenimage.yaml": "test_qwenimage.py", "demo-flux2.yaml": "test_flux2.py",
    "demo-flux2-klein.yaml": "test_flux2.py", "demo-flux-kontext.yaml": "test_flux_kontext.py",
    "detection-demo.yaml": "test_detection.py", "detection-rtdetr-demo.yaml": "test_detection_detr.py",
}
DEMO_PRESETS = [p for p in PRESETS if yaml.safe_load(p.read_text())["data"]["path"].startswith(DEMO_SCHEME)
                and p.name not in {*TRAINED_ELSEWHERE, *TRAINED_IN_DEMO_PRESETS}]


def _skip_without_cuda_packages(preset: Path) -> None:
    """A preset whose keys need a CUDA-only package cannot run on the CPU: skipped with the package and why."""
    needs = extras_needed(load_config(preset, [], check_paths=False))
    for extra in EXTRAS:
        if extra.cuda_only and extra.name in needs:
            pytest.skip(f"{preset.name}: {needs[extra.name]} needs `{extra.module}` ({extra.name} extra), whose "
                        "kernels run on CUDA GPUs only")


def _demo_data(preset: Path) -> list[str]:
    """The data of the preset's family's demo (its images and, for an edit family, their control images): a real
    preset names the user's data, which is not here."""
    family = yaml.safe_load(preset.read_text())["model"]["family"]
    data = yaml.safe_load((REPO / "presets" / SPECS[family].demo_preset).read_text())["data"]
    return [f"data.{key}={data[key]}" for key in ("path", "control_path") if key in data]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_passes_dry_run(preset, tmp_path, monkeypatch, capsys):
    _skip_without_cuda_packages(preset)
    monkeypatch.chdir(tmp_path)
    # A real preset names a hub model, which the test session's HF_HUB_OFFLINE=1 refuses; a dry run downloads
    # nothing (it reads no file of the model), as the empty folder below shows.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # The same answer as the launcher's probe subprocess, without starting one per preset (torch is loaded here).
    monkeypatch.setattr(hardware, "probe_in_subprocess", probe)
    code = launch.main(["--preset", str(preset), "--dry-run", "--runs-dir", str(tmp_path / "runs"),
                        *_demo_data(preset)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert " = batch " in out.out  # the plan line
    raw = yaml.safe_load(preset.read_text())
    if not raw["data"]["path"].startswith(DEMO_SCHEME) and SPECS[raw["model"]["family"]].sizes:
        # a GPU preset names its card (hardware.gpu_memory_gb), and its plan estimates the memory for it here
        assert "memory: peak ~" in out.out and f" GB of {raw['hardware']['gpu_memory_gb']:g} GB: " in out.out
        if raw.get("method", "lora") == "lora":  # (a full fine-tune's FSDP preset plans for several GPUs)
            assert "expect out-of-memory" not in out.out  # it plans under its card's memory, auto choices included
        # a header quoting the plan's estimate quotes today's
        quoted = re.search(r"^# The plan's memory estimate \(.*?\): (peak ~.*?)\.$", preset.read_text(), re.M)
        assert quoted is None or f"memory: {quoted.group(1)} (" in out.out, quoted
    assert not any(tmp_path.iterdir()), "a dry run creates nothing"


def test_every_extra_the_keys_pull_in_is_declared_in_pyproject():
    """extras.py's table names real extras of pyproject.toml, each installing the module the code imports."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in EXTRAS:
        assert extra.name in extras, f"pyproject.toml has no `{extra.name}` extra"
        names = {Requirement(r).name.lower().replace("-", "_") for r in extras[extra.name]}
        assert extra.module in names, f"the `{extra.name}` extra does not install `{extra.module}`"


def test_the_presets_trained_elsewhere_are_trained_there():
    """The modules named in TRAINED_ELSEWHERE still read their preset and launch a run of it (`launch(` of
    tests/engine_helpers or tests/flow_family_runs, which wraps it)."""
    for preset, module in TRAINED_ELSEWHERE.items():
        text = (REPO / "tests" / module).read_text()
        assert preset in text, f"{module} no longer trains {preset}: start it here again (TRAINED_ELSEWHERE)"
        assert "launch(" in text or "flow_runs." in text, module


@pytest.mark.slow
@pytest.mark.parametrize("preset", DEMO_PRESETS, ids=lambda p: p.stem)
def test_every_demo_preset_trains_a_step_to_done(preset, tmp_path):
    _skip_without_cuda_packages(preset)
    # The preset as shipped, one step, with the fewest samples and evaluations: what this proves is that everything
    # the preset needs is installed and starts (drawing samples is each family's own tests' subject). sample.every=0
    # still draws at the start and the end: one image per prompt at 2 denoising steps, not demo-dreambooth's 4 at
    # 20 (~8 s of this test on one core).
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--preset", str(preset), "--runs-dir", str(tmp_path / "runs"),
         "train.steps=1", "sample.every=0", "sample.steps=2", "sample.images_per_prompt=1", "eval.every=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    run_dir = next((tmp_path / "runs").glob(preset.stem + "*"))
    events = read_events(run_dir)
    assert result.returncode == 0 and events[-1]["type"] == "done", result.stdout[-3000:] + result.stderr[-3000:]
    assert events[-1]["outputs"] and all((run_dir / o).exists() for o in events[-1]["outputs"])

