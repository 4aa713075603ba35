"""The Dataset tab's caption tools without a browser: editing one caption, the bulk changes' preview and apply,
the auto-captioning process's command line, and what an exposed UI confines (app.captions, app.caption_job)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PIL import Image

from app import captions as C
from app.caption_job import CaptionJob, CaptionRequest, captioner_arg
from app.security import Workspace
from trainer.errors import UserError


def dataset(root: Path) -> Path:
    folder = root / "data"
    (folder / "2_sks").mkdir(parents=True)
    for rel, caption in (("a.png", "sks, a cat, grass"), ("b.png", "a dog, grass"), ("2_sks/c.png", None)):
        Image.new("RGB", (8, 8)).save(folder / rel)
        if caption is not None:
            (folder / rel).with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    return folder


def text(folder: Path, rel: str) -> str:
    return (folder / rel).read_text(encoding="utf-8")


def test_bulk_changes_are_previewed_then_applied_as_previewed(tmp_path):
    folder = dataset(tmp_path)
    changes = C.preview(folder, "Replace text", "grass", "snow")
    assert [c.image.name for c in changes] == ["a.png", "b.png"] and changes[0].after == "sks, a cat, snow"
    assert text(folder, "a.txt") == "sks, a cat, grass\n"  # a preview writes nothing
    (folder / "b.txt").write_text("edited meanwhile\n", encoding="utf-8")
    assert C.apply(changes) == (1, 1)
    assert text(folder, "a.txt") == "sks, a cat, snow\n" and text(folder, "b.txt") == "edited meanwhile\n"

    added = C.preview(folder, "Add tag", "sks")  # a.png has it already; the uncaptioned image gets it alone
    assert {c.image.name: c.after for c in added} == {"b.png": "edited meanwhile, sks", "c.png": "sks"}
    C.apply(added)
    removed = C.preview(folder, "Remove tag", " sks ")
    assert {c.image.name: c.after for c in removed} == {"a.png": "a cat, snow", "b.png": "edited meanwhile",
                                                          "c.png": ""}
    with pytest.raises(UserError, match="text to find"):
        C.preview(folder, "Add tag", "  ")


def test_a_caption_is_saved_only_beside_an_image_of_the_folder(tmp_path):
    folder = dataset(tmp_path)
    ws = Workspace(tmp_path, confined=True)
    assert C.save_caption(ws, str(folder), "2_sks/c.png", "a bird\n") == folder / "2_sks/c.txt"
    assert text(folder, "2_sks/c.txt") == "a bird\n"
    (tmp_path / "other.png").write_bytes(b"")
    for rel in ("../other.png", "a.txt", "/etc/passwd"):
        with pytest.raises(UserError, match="is not an image of"):
            C.save_caption(ws, str(folder), rel, "x")
    with pytest.raises(UserError, match="outside the workspace"):
        C.save_caption(Workspace(folder / "2_sks", confined=True), str(folder), "a.png", "x")
    (tmp_path / "elsewhere").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "elsewhere" / "d.png")
    (folder / "linked").symlink_to(tmp_path / "elsewhere")  # a linked folder is not entered: nothing written there
    with pytest.raises(UserError, match="is not an image of"):
        C.save_caption(ws, str(folder), "linked/d.png", "x")
    assert not (tmp_path / "elsewhere" / "d.txt").exists()


def test_an_exposed_ui_confines_the_folder_and_the_model_path_and_allows_plain_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ws = Workspace(tmp_path / "ws", confined=True)
    (tmp_path / "ws" / "model").mkdir(parents=True)
    assert captioner_arg(ws, "wd-tagger") == "wd-tagger" and captioner_arg(ws, "") == "florence2"
    assert captioner_arg(ws, "microsoft/Florence-2-large") == "microsoft/Florence-2-large"
    assert captioner_arg(ws, str(tmp_path / "ws" / "model")) == str(tmp_path / "ws" / "model")
    (tmp_path / "evil").mkdir()  # `evil/x` names a local folder's child, not a hub repo
    for value in ("evil/x", "/etc", "../../x", "https://host/owner/name"):
        with pytest.raises(UserError, match="outside the workspace"):
            captioner_arg(ws, value)
    with pytest.raises(UserError, match="outside the workspace"):
        CaptionRequest(str(tmp_path)).command(ws)


def test_the_captioning_command_line_is_flags_with_values_attached(tmp_path):
    folder = dataset(tmp_path)
    command = CaptionRequest(str(folder), "wd-tagger", "-sks, ", True, "", 0.5).command(Workspace(tmp_path))
    assert command == [sys.executable, "-m", "launch", "--caption", str(folder), "--captioner=wd-tagger",
                       "--prefix=-sks, ", "--caption-extension=.txt", "--threshold=0.5", "--overwrite"]


@pytest.mark.slow
def test_a_captioning_that_fails_says_why_on_the_page(tmp_path):
    folder = dataset(tmp_path)
    (tmp_path / "not-a-model").mkdir()
    job = CaptionJob(Workspace(tmp_path))
    job.start(CaptionRequest(str(folder), str(tmp_path / "not-a-model")))
    assert job.wait(120) == 2
    assert job.status().startswith("Failed (exit 2): error: --captioner") and "no config.json" in job.status()


def test_the_tabs_caption_extension_is_used_and_can_never_name_an_image(tmp_path):
    folder = dataset(tmp_path)
    (folder / "a.caption").write_text("from the other extension\n", encoding="utf-8")
    assert dict((p.name, c) for p, c in C.captions_of(folder, ".caption"))["a.png"] == "from the other extension"
    C.apply(C.preview(folder, "Add tag", "sks", extension=".caption"))
    assert text(folder, "a.caption") == "from the other extension, sks\n" and text(folder, "a.txt") == "sks, a cat, grass\n"
    for bad in (".png", ".JPG", "txt", "./x", ".a/b"):
        with pytest.raises(UserError, match="Caption extension"):
            C.save_caption(Workspace(tmp_path), str(folder), "a.png", "x", bad)
    assert (folder / "a.png").stat().st_size > 0
