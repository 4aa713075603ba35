"""Auto-captioning (trainer.captioning, `launch.py --caption`): which captioner a name, folder or hub id means,
which images get a caption, the prefix, keeping or overwriting existing captions, atomic writes, and the errors a
user can fix. The fast tests use a stand-in captioner; the slow ones load tiny random models of the real
architectures (tests/captioner_models.py) through the same from_pretrained path a downloaded model takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

import launch
from trainer.captioning import files
from trainer.captioning.registry import CAPTIONERS, resolve
from trainer.captioning.__main__ import main as caption_main
from trainer.captioning.run import caption_folder
from trainer.errors import UserError

REPO = Path(__file__).resolve().parents[1]

def image_folder(root: Path) -> Path:
    """a.png (no caption), b.jpg (a hand-written caption), 5_sks/c.png (kohya sub-folder), .cache/d.png (hidden)."""
    root.mkdir(parents=True, exist_ok=True)
    for rel in ("a.png", "b.jpg", "5_sks/c.png", ".cache/d.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), (200, 30, 30)).save(root / rel)
    (root / "b.txt").write_text("my own words\n", encoding="utf-8")
    return root


class FakeCaptioner:
    device = "cpu"

    def __init__(self):
        self.closed = False
        self.seen: list[tuple[int, int]] = []

    def caption(self, image):
        self.seen.append(image.size)
        return "a red\nsquare "

    def close(self):
        self.closed = True


def test_captions_only_uncaptioned_images_with_the_prefix_and_closes_the_model(tmp_path):
    folder = image_folder(tmp_path / "data")
    fake, lines = FakeCaptioner(), []
    result = caption_folder(folder, CAPTIONERS["florence2"], lambda spec: fake, prefix="sks, ", say=lines.append)
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks, a red square\n"
    assert (folder / "5_sks/c.txt").read_text(encoding="utf-8") == "sks, a red square\n"
    assert (folder / "b.txt").read_text(encoding="utf-8") == "my own words\n"  # kept: no --overwrite
    assert not (folder / ".cache/d.txt").exists()
    assert [p.name for p in result.written] == ["a.txt", "c.txt"] and [p.name for p in result.kept] == ["b.jpg"]
    assert fake.closed
    progress = [line for line in lines if line.startswith("caption ")]
    assert progress[0].startswith("caption 1/2 a.png") and progress[-1] == "caption 2/2 c.png · 0:00 left"
    assert not list(folder.rglob("*.tmp"))


def test_overwrite_replaces_existing_captions_and_nothing_to_do_loads_no_model(tmp_path):
    folder = image_folder(tmp_path / "data")
    caption_folder(folder, CAPTIONERS["florence2"], lambda spec: FakeCaptioner(), say=lambda _: None)

    def no_model(spec):
        raise AssertionError("every image has a caption: nothing to load")

    assert caption_folder(folder, CAPTIONERS["florence2"], no_model, say=lambda _: None).written == []
    caption_folder(folder, CAPTIONERS["florence2"], lambda spec: FakeCaptioner(), overwrite=True,
                   say=lambda _: None)
    assert (folder / "b.txt").read_text(encoding="utf-8") == "a red square\n"


def test_a_failed_write_leaves_the_old_caption_whole(tmp_path, monkeypatch):
    target = tmp_path / "x.txt"
    target.write_text("old caption\n", encoding="utf-8")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        files.write_caption(target, "new caption")
    assert target.read_text(encoding="utf-8") == "old caption\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_the_model_is_released_when_captioning_fails(tmp_path):
    folder = image_folder(tmp_path / "data")
    fake = FakeCaptioner()
    fake.caption = lambda image: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        caption_folder(folder, CAPTIONERS["florence2"], lambda spec: fake, say=lambda _: None)
    assert fake.closed and not (folder / "a.txt").exists()


def saved_config(folder: Path, config: dict, tags: bool = False) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if tags:
        (folder / "selected_tags.csv").write_text("tag_id,name,category,count\n", encoding="utf-8")
    return str(folder)


def test_a_captioner_is_a_registry_name_a_model_folder_or_a_hub_id(tmp_path):
    assert resolve(None).name == "florence2"
    assert resolve("qwen3-vl", instruction="Tag it.").instruction == "Tag it."
    assert resolve(saved_config(tmp_path / "q", {"model_type": "qwen2_5_vl"})).kind == "chat"
    assert resolve(saved_config(tmp_path / "f", {"model_type": "florence2"})).instruction == "<MORE_DETAILED_CAPTION>"
    tagger = resolve(saved_config(tmp_path / "t", {"architecture": "vit_base_patch16_224"}, tags=True), threshold=0.5)
    assert (tagger.kind, tagger.threshold) == ("tagger", 0.5)
    asked = []
    hub = resolve("someone/llava-captioner", config_of=lambda repo: asked.append(repo) or ({"model_type": "llava"}, False))
    assert (hub.kind, hub.model, asked) == ("chat", "someone/llava-captioner", ["someone/llava-captioner"])


@pytest.mark.parametrize("value, words", [
    ("no-such-thing", "neither a captioner"),
    ("../up/and/away", "neither a captioner"),
    ("MODEL_TYPE_BERT", "model_type 'bert' is not a captioner"),
    ("EMPTY_FOLDER", "has no config.json"),
])
def test_an_unknown_captioner_is_named_with_what_to_use_instead(tmp_path, value, words):
    if value == "MODEL_TYPE_BERT":
        value = saved_config(tmp_path / "bert", {"model_type": "bert"})
    elif value == "EMPTY_FOLDER":
        (tmp_path / "empty").mkdir()
        value = str(tmp_path / "empty")
    with pytest.raises(UserError, match=words):
        resolve(value)


def test_a_threshold_outside_0_1_is_refused():
    with pytest.raises(UserError, match="between 0 and 1"):
        resolve("wd-tagger", threshold=1.5)


def test_the_tagger_without_timm_names_the_extra(monkeypatch):
    from trainer.captioning import models

    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(UserError, match=r"imagetune\[caption\]"):
        models._load_tagger(CAPTIONERS["wd-tagger"], "cpu", None)


def test_launch_caption_of_a_missing_folder_is_one_error_exit_2(tmp_path, capsys):
    assert launch.main(["--caption", str(tmp_path / "nowhere"), "--captioner", "wd-tagger"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --caption") and "no such folder" in err and "Traceback" not in err
    assert launch.main(["--prefix", "sks, "]) == 2
    assert "go with --caption FOLDER" in capsys.readouterr().err
    folder = image_folder(tmp_path / "data")
    assert launch.main(["--caption", str(folder), "--caption-extension", ".png"]) == 2  # never over the images
    assert "Caption extension '.png'" in capsys.readouterr().err


# Tiny real models, loaded back through from_pretrained / timm's local-dir


@pytest.fixture(scope="module")
def tiny_captioners(tmp_path_factory):
    from tests import captioner_models as cm

    root = tmp_path_factory.mktemp("captioners")
    return {name: build(root / name) for name, build in (("florence2", cm.build_florence2),
                                                         ("qwen2.5-vl", cm.build_qwen25_vl),
                                                         ("joycaption", cm.build_llava),
                                                         ("wd-tagger", cm.build_tagger))}


@pytest.mark.slow
def test_every_kind_of_captioner_writes_captions_from_a_saved_model(tiny_captioners, tmp_path):
    from trainer.captioning.models import load

    for name, model in tiny_captioners.items():
        folder = image_folder(tmp_path / name)
        spec = replace(resolve(str(model), threshold=0.01 if name == "wd-tagger" else None), max_new_tokens=4)
        assert spec.kind == CAPTIONERS[name].kind
        lines: list[str] = []
        result = caption_folder(folder, spec, load, prefix="sks, ", overwrite=True, say=lines.append)
        assert len(result.written) == 3, (name, lines)
        for path in result.written:
            text = path.read_text(encoding="utf-8")
            assert text.startswith("sks, ") and len(text) > len("sks, \n"), (name, text)
        if name == "joycaption":  # the registry's own entry: a system message, the instruction as plain text
            joy = replace(CAPTIONERS["joycaption"], model=str(model), max_new_tokens=4)
            assert len(caption_folder(folder, joy, load, overwrite=True, say=lines.append).written) == 3
        if name == "wd-tagger":  # every tag scores above 0.01; booru underscores become spaces
            from tests.captioner_models import TAGS

            assert set(text[len("sks, "):].strip().split(", ")) == {t.replace("_", " ") for t in TAGS}


@pytest.mark.slow
def test_an_unloadable_model_is_one_error_exit_2(tiny_captioners, tmp_path, capsys):
    broken = tmp_path / "broken"  # a config.json without the weights and processor beside it
    broken.mkdir()
    (broken / "config.json").write_text((tiny_captioners["joycaption"] / "config.json").read_text())
    folder = image_folder(tmp_path / "data")
    assert caption_main([str(folder), "--captioner", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --captioner {broken}: the chat model could not be loaded") and "Traceback" not in err
    assert not (folder / "a.txt").exists()


@pytest.mark.slow
def test_launch_caption_with_a_tagger(tiny_captioners, tmp_path, monkeypatch, capsys):
    """launch.py checks, then starts the captioning process; here that process's main runs in this one (the
    command line it gets is parsed as the real process would, a prefix starting with a dash included)."""
    def in_process(command, env):
        assert command[1:3] == ["-m", "trainer.captioning"] and str(REPO) in env["PYTHONPATH"]
        return subprocess.CompletedProcess(command, caption_main(command[3:]))

    monkeypatch.setattr(subprocess, "run", in_process)
    folder = image_folder(tmp_path / "data")
    assert launch.main(["--caption", str(folder), "--captioner", str(tiny_captioners["wd-tagger"]), "--threshold",
                        "0.01", "--prefix", "-sks-, "]) == 0
    out = capsys.readouterr().out
    assert "caption 2/2 c.png" in out and "captioned 2 image(s), kept 1 existing caption(s)" in out
    tags = (folder / "a.txt").read_text(encoding="utf-8").strip().split(", ")
    assert tags[0] == "-sks-" and len(tags) == 7  # the prefix, then every tag (all score above 0.01)
    assert (folder / "b.txt").read_text(encoding="utf-8") == "my own words\n"
