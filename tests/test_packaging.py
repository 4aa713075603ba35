"""`pip install` gives an `imagetune` command that works from any folder, with the shipped presets."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_imagetune_command_finds_the_shipped_presets_from_any_folder(tmp_path):
    command = shutil.which("imagetune")
    if command is None:
        pytest.skip("the `imagetune` command is not installed here (pip install -e . installs it)")
    result = subprocess.run([command, "--preset", "demo", "--dry-run", "devices=cpu:1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "plan: 1 process x 2 per device x accumulation 2 = batch 4" in result.stdout
    assert "path: demo://tiny-sd" in result.stdout
    assert not any(tmp_path.iterdir())  # a dry run creates nothing


@pytest.mark.slow
def test_the_wheel_ships_the_command_and_the_presets(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    [wheel] = tmp_path.glob("imagetune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {p.name for p in (REPO / "presets").glob("*.yaml")}
    assert {Path(n).name for n in names if n.startswith("presets/")} >= shipped
    assert "launch.py" in names and "trainer/families/sd/spec.py" in names
    shipped_model = REPO / "trainer" / "assets" / "tiny-sd"  # the demo's pretrained base, every file of it
    assert {n for n in names if n.startswith("trainer/assets/tiny-sd/")} == {
        p.relative_to(REPO).as_posix() for p in shipped_model.rglob("*") if p.is_file()}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "imagetune = launch:cli" in zipfile.ZipFile(wheel).read(entry_points).decode()
