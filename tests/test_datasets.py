"""Several image folders in one run (`data.datasets`): each folder trains with its own repeats, resolution, flip
and caption settings; regularization folders pair with every sample as prior preservation; every optimizer step
has one shape; bad entries are refused naming the entry; an exposed UI confines the entries' paths; and real
runs train to done on the tiny SD, SDXL and FLUX models."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.engine_helpers import launch
from tests.test_caption_augment import _context
from tests.test_captioned_latents import _VAE
from trainer.core.config import load_config
from trainer.core.data.holdout import training_scan
from trainer.core.data.stream import make_stream
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.errors import ConfigError
from trainer.families.protocol import Sample


def _folder(path: Path, count: int, caption: str | None, colour=(200, 40, 40)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        image = Image.new("RGB", (64, 64), (colour[0], colour[1] + 20 * n, colour[2]))
        image.paste((255, 255, 255), (0, 0, 24, 64))  # a white band on the left: a flip shows
        image.save(path / f"img{n}.png")
        if caption is not None:
            (path / f"img{n}.txt").write_text(f"{caption} {n}")
    return path


@pytest.fixture
def folders(tmp_path):
    """dog: 4 captioned images; style: a kohya `3_blue square` folder of 2 uncaptioned ones; reg: 2 images."""
    dog = _folder(tmp_path / "dog", 4, "sks dog")
    style = tmp_path / "style"
    _folder(style / "3_blue square", 2, None, colour=(40, 40, 200))
    reg = _folder(tmp_path / "reg", 2, None, colour=(90, 90, 90))
    return dog, style, reg


def _datasets(dog, style, reg) -> str:
    return ("data.datasets=["
            f"{{path: {dog}, repeats: 2, caption_prefix: sksA}}, "
            f"{{path: {style}, resolution: 16, flip: true, caption_dropout: 0.5}}, "
            f"{{path: {reg}, is_regularization: true, instance_prompt: a photo of a shape}}]")


def _config(folders, *extra):
    return load_config(None, ["model.path=stand-in/model", "data.resolution=32", "precision=fp32", "devices=cpu:1",
                              "batch.total=2", "prior.loss_weight=0.5", _datasets(*folders), *extra],
                       check_paths=False)


def test_each_folder_trains_with_its_own_repeats_resolution_flip_and_captions(tmp_path, folders):
    from trainer.families.components.captioned_latents import CaptionedLatents

    config = _config(folders)
    data = CaptionedLatents(_context(tmp_path, config)[0], _VAE())
    epoch = data.prepare()
    dogs = [i for i, item in enumerate(data.images) if item.dataset == 0]
    styles = [i for i, item in enumerate(data.images) if item.dataset == 1]
    assert len(dogs) == 4 and len(styles) == 2
    assert epoch == 4 * 2 + 2 * 3  # the entry's repeats times the kohya folder's
    assert Counter(data.images[i].dataset for i in data.expanded) == {0: 8, 1: 6}

    # Resolution: each folder's own; every latent the loss gets has its folder's shape.
    assert {data.target(i, "instance") for i in dogs} == {(32, 32)}
    assert {data.target(i, "instance") for i in styles} == {(16, 16)}
    assert data.latent_dist(dogs[0], 0, 0, "instance")[0].shape[-2:] == (4, 4)
    assert data.latent_dist(styles[0], 0, 0, "instance")[0].shape[-2:] == (2, 2)
    # ... and every optimizer step's batch is of one shape.
    stream = make_stream(epoch, item_buckets=data.item_buckets, total=2, per_device=2, world_size=1, seed=0)
    for step in range(20):
        shapes = {data.target(data.expanded[stream.item(p)[1]], "instance") for p in stream.positions(step, 0, 0)}
        assert len(shapes) == 1

    # Flip: the style folder's images are mirrored about half the time, the dog's never.
    def mirrored(index):
        plain = data._pixels(data.images[index].path, False, data.target(index, "instance"))
        flips = 0
        for epoch_ in range(40):
            mean = data.latent_dist(index, epoch_, 0, "instance")[0]
            flips += not torch.allclose(mean, torch.nn.functional.avg_pool2d(plain[None], 8)[0], atol=1e-5)
        return flips
    assert data.flips(styles[0], "instance") and not data.flips(dogs[0], "instance")
    assert mirrored(dogs[0]) == 0 and 8 < mirrored(styles[0]) < 32

    # Captions: the dog folder's prefix; the style folder's kohya prompt, dropped about half the time.
    dog_captions = [data.row_caption((p, 0, dogs[0], 0, "instance")) for p in range(400)]
    assert set(dog_captions) == {"sksA sks dog 0"}
    style_captions = Counter(data.row_caption((p, 0, styles[0], 0, "instance")) for p in range(400))
    assert set(style_captions) == {"blue square", ""} and 140 < style_captions[""] < 260

    # Regularization: never in an epoch; each sample is paired with one, on its own caption, at weight 0.5.
    assert len(data.class_images) == 2 and all(item.dataset == 2 for item in data.class_images)
    assert not any(data.images[i].dataset == 2 for i in data.expanded)
    instance, prior = data.rows([Sample(7, 0, 3)])
    assert [row[-1] for row in prior] == ["class"]
    assert data.row_caption(prior[0]) == "a photo of a shape"
    assert data.target(prior[0][2], "class") == 32
    losses = {"instance": 1.0, "class": 4.0}
    loss = data.loss([Sample(7, 0, 3)], lambda rows, stream: torch.tensor([losses[r[-1]] for r in rows]))
    assert loss.item() == pytest.approx(1.0 + 0.5 * 4.0)
    assert "a photo of a shape" in data.captions() and "sksA sks dog 0" in data.captions()


def test_the_plan_lists_each_folders_shape_and_held_out_images_come_from_every_folder(folders):
    config = _config(folders, "data.val_split=0.34")
    scan = training_scan(config, resolution=config.data.resolution)
    assert len(scan.items) + len(scan.held_out) == 6 and len(scan.held_out) == 2
    assert len(scan.regularization) == 2 and all(item.dataset == 2 for item in scan.regularization)
    plan = make_plan(config, CPU_ONLY).with_buckets(config, scan)
    assert {(w, h) for w, h, _ in plan.buckets} == {(32, 32), (16, 16)}


def test_bad_entries_are_refused_naming_the_entry(folders, tmp_path):
    dog, style, reg = folders
    cases = {
        f"data.datasets=[{{path: {dog}, pathh: x}}]": "data.datasets: Key 'pathh' not in 'DatasetEntry'",
        f"data.datasets=[{{path: {dog}, repeats: 0}}]": "data.datasets[0].repeats: must be 1 or more",
        f"data.datasets=[{{path: {tmp_path / 'nope'}}}]": "data.datasets[0].path: folder",
        f"data.datasets=[{{path: {reg}, is_regularization: true}}]": "at least one folder must hold the images",
        f"data.datasets=[{{path: {dog}, resolution: 30}}]": "data.datasets[0].resolution: must be a multiple of 8",
        (f"data.datasets=[{{path: {dog}}}, {{path: {reg}, is_regularization: true, resolution: 16}}, "
         f"{{path: {style}, is_regularization: true}}]"): "regularization folders have different resolutions",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.path=demo://tiny-sd", override])
        assert message in str(err.value), override
    with pytest.raises(ConfigError, match="data.path: set together with data.datasets"):
        load_config(None, ["model.path=demo://tiny-sd", f"data.path={dog}", f"data.datasets=[{{path: {style}}}]"])
    with pytest.raises(ConfigError, match="prior.enabled: generates class images"):
        load_config(None, ["model.path=demo://tiny-sd", "prior.enabled=true", f"prior.class_path={tmp_path}",
                           "prior.class_prompt=a dog", f"data.datasets=[{{path: {dog}}}, "
                           f"{{path: {reg}, is_regularization: true}}]"])
    with pytest.raises(ConfigError, match="data.datasets: not for detection"):
        load_config(None, ["model.family=detection", "method=full", "model.path=fasterrcnn_mobilenet_v3_large_fpn",
                           "detection.weights=none", "data.path=demo://shapes-coco", f"data.datasets=[{{path: {dog}}}]"])


def test_an_exposed_ui_refuses_an_entry_outside_its_workspace(tmp_path, folders):
    from app.security import Workspace

    dog, _, _ = folders
    inside = Workspace(dog.parent, confined=True)
    config = load_config(None, ["model.path=demo://tiny-sd", f"data.datasets=[{{path: {dog}}}]"])
    assert inside.built_problems(config) == []
    elsewhere = Workspace(tmp_path / "ws", confined=True)
    (tmp_path / "ws").mkdir()
    assert "data.datasets[0].path: " in " ".join(elsewhere.built_problems(config))
    assert elsewhere.config_problems({"data.datasets": [{"path": str(dog)}]})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_a_run_with_several_folders_trains_to_done(family, tmp_path, tiny_sdxl_path, tiny_flux_path, demo_data_path):
    """The demo preset with two folders at two resolutions and a regularization folder, three steps, on the tiny
    SDXL and FLUX models (SD shares their data pipeline, tested above): it trains to done, the plan lists both
    shapes, and the LoRA is written."""
    model = {"sdxl": tiny_sdxl_path, "flux": tiny_flux_path}[family]
    second = _folder(tmp_path / "second", 2, "a blue square", colour=(40, 40, 200))
    reg = _folder(tmp_path / "reg", 2, "a photo of a shape", colour=(90, 90, 90))
    config = load_config(Path(__file__).parents[1] / "presets" / "demo.yaml", [
        f"model.family={family}", f"model.path={model}", 'data.path=""', "train.steps=3", "sample.every=0",
        "sample.steps=1", "sample.prompts=[sks circle]", "sample.images_per_prompt=1", "checkpoint.every=0",
        "batch.total=2", "devices=cpu:1", "lora.train_text_encoder=false", "data.resolution=32",
        f"data.datasets=[{{path: {demo_data_path}, repeats: 2}}, {{path: {second}, resolution: 16, flip: true}}, "
        f"{{path: {reg}, is_regularization: true}}]"])
    run_dir, final = launch(tmp_path / "runs", config)
    assert final["type"] == "done", final
    events = [line for line in (run_dir / "events.jsonl").read_text().splitlines() if '"plan"' in line]
    assert "32x32" in events[0] and "16x16" in events[0]
    assert (run_dir / "output" / "pytorch_lora_weights.safetensors").exists()
