"""The New run tab's import (app.imports): an uploaded kohya_ss / sd-scripts / ai-toolkit config becomes a user
preset with its report; an exposed UI's import reads nothing outside the workspace beyond the upload itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image

from app.imports import import_upload
from app.presets import Presets
from app.security import Workspace
from trainer.core.data.confine import CONFINE_ENV
from trainer.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures" / "importers"


def upload(tmp_path: Path, name: str, **tokens: Path) -> Path:
    """The fixture as Gradio stores an upload: in a folder of its own, outside the workspace."""
    text = (FIXTURES / name).read_text()
    for token, path in tokens.items():
        text = text.replace(token, str(path))
    folder = tmp_path / "gradio-upload"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def images(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for n in range(2):
        Image.new("RGB", (64, 64)).save(folder / f"{n}.png")
    return folder


def test_an_uploaded_kohya_config_becomes_a_user_preset_with_its_report(tmp_path):
    presets = Presets(tmp_path / "home" / "presets")
    source = upload(tmp_path, "kohya_ss_sdxl_lora.json", IMAGES=images(tmp_path / "ws" / "img"))
    report = import_upload(presets, Workspace(tmp_path / "ws"), str(source), "sdxl-from-kohya")
    assert report.preset_id == "user/sdxl-from-kohya"
    assert (presets.user_dir / "sdxl-from-kohya.yaml").is_file()
    assert "user/sdxl-from-kohya" in [value for _, value in presets.choices()]
    assert "Imported as the preset sdxl-from-kohya" in report.html and "Not imported (" in report.html
    with pytest.raises(UserError, match="exists already"):
        import_upload(presets, Workspace(tmp_path / "ws"), str(source), "sdxl-from-kohya")
    for name, words in (("../escape", "A preset name uses"), ("ok", "import a kohya_ss GUI .json")):
        bad = source if name != "ok" else shutil.copy(source, source.with_suffix(".txt"))
        with pytest.raises(UserError, match=words):
            import_upload(presets, Workspace(tmp_path / "ws"), str(bad), name)


def test_an_exposed_ui_reads_no_file_outside_the_workspace_that_the_config_names(tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setenv(CONFINE_ENV, str(ws))  # what app.main sets for an exposed UI
    presets = Presets(tmp_path / "home" / "presets")
    outside = tmp_path / "outside"
    outside.mkdir()
    dataset = upload(tmp_path, "sd_scripts_flux_dataset.toml", IMAGES=images(ws / "img"))
    shutil.move(dataset, outside / dataset.name)
    source = upload(tmp_path, "sd_scripts_flux_lora.toml", MODELS=ws)
    source.write_text(source.read_text().replace('"sd_scripts_flux_dataset.toml"', f'"{outside / dataset.name}"'))
    with pytest.raises(UserError, match="outside the workspace"):
        import_upload(presets, Workspace(ws, confined=True), str(source), "flux")
    assert not (presets.user_dir / "flux.yaml").exists()
    secret = outside / "prompts.txt"
    secret.write_text("a secret line\n")  # a prompt file outside: not read, its lines never reach the page
    gui = upload(tmp_path, "kohya_ss_sdxl_lora.json", IMAGES=images(outside / "img"))
    gui.write_text(gui.read_text().replace('"sample_prompts": ""', f'"sample_prompts": "{secret}"'))
    report = import_upload(presets, Workspace(ws, confined=True), str(gui), "sdxl")
    written = (presets.user_dir / "sdxl.yaml").read_text()
    assert "a secret line" not in written and "a secret line" not in report.html
    assert "outside the workspace" in report.html  # data.path: the run would be refused; said at import
