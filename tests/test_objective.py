"""What the diffusion families' loss is (trainer.families.components.objective), shown by its effect on SD, SDXL
and FLUX loaded once each:

- masked loss (`data.masks`): a mask gets exactly its image's resize, crop and flip and is shrunk to the latent;
  what lies outside it contributes nothing (a fully masked image gives exactly zero gradient, a huge error outside
  a half mask leaves the loss unchanged); folder masks are found by name, missing or mis-sized ones are refused;
- `train.loss`: huber and l1 give the documented values against a hand computation, and reach every family;
- `train.input_perturbation`: the model's input gets exactly gamma x the sample's next noise draw, the target none;
- `model.zero_terminal_snr`: alphas_cumprod[-1] is 0 for training (diffusers' rescale), samplers and the saved
  scheduler get the rescale with trailing spacing, and an epsilon model is refused with the reason.
"""

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.test_caption_augment import _context
from trainer.core.config import load_config
from trainer.core.data.masks import check_masks, mask_file
from trainer.core.data.holdout import training_scan
from trainer.errors import ConfigError, UserError
from trainer.families.components.captioned import load_image_tensor, sample_rng
from trainer.families.components.mask_tensors import load_mask_tensor
from trainer.families.components.objective import Objective
from trainer.families.protocol import Sample


def _rgba(path: Path, size=(64, 64), opaque_fraction=0.5) -> Path:
    """Red where opaque (the left `opaque_fraction` of the width), transparent elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGBA", size, (0, 0, 255, 0))
    cut = round(size[0] * opaque_fraction)
    if cut:
        img.paste((255, 0, 0, 255), (0, 0, cut, size[1]))
    img.save(path)
    return path


def masked_dataset(folder: Path) -> Path:
    """img0 fully transparent, img1 opaque on its left half, img2 plain RGB (no alpha: trains whole)."""
    _rgba(folder / "img0.png", opaque_fraction=0.0)
    _rgba(folder / "img1.png", opaque_fraction=0.5)
    Image.new("RGB", (64, 64), (30, 160, 60)).save(folder / "img2.png")
    for n in range(3):
        (folder / f"img{n}.txt").write_text(f"a red square {n}")
    return folder


def test_a_mask_gets_its_images_crop_flip_and_bucket(tmp_path):
    path = _rgba(tmp_path / "wide.png", size=(96, 64), opaque_fraction=0.4)
    mirrored = 0
    for target, crop in ((32, "random"), ((48, 32), "random"), ((40, 40), "center")):
        for index in range(6):
            image = load_image_tensor(str(path), target, crop=crop, flip=True, rng=sample_rng(3, 1, index))
            mask = load_mask_tensor(str(path), "alpha", [], target, crop=crop, flip=True, rng=sample_rng(3, 1, index))
            assert mask is not None and mask.shape == image.shape[1:]
            red = (image[0] > 0.5) & (image[1] < 0)  # opaque red; transparent pixels turn white
            agree = ((mask > 0.5) == red).float().mean()
            assert agree > 0.95, (target, crop, index, float(agree))
            mirrored += int(red[:, -1].any())  # the red part is on the right: this sample was flipped
    assert 0 < mirrored < 18  # both sides occur, so the test can tell a mask that misses the flip


def test_folder_masks_are_found_by_name_and_missing_or_mis_sized_ones_are_refused(tmp_path):
    data = tmp_path / "data"
    _rgba(data / "2_sks square" / "a.png")
    _rgba(data / "b.png", opaque_fraction=0.25)
    masks = tmp_path / "masks"
    (masks / "2_sks square").mkdir(parents=True)
    for rel in ("2_sks square/a.png", "b.png"):  # the mask drawn as a greyscale file: the alpha channel
        with Image.open(data / rel) as img:
            img.getchannel("A").save(masks / rel)
    config = load_config(None, ["model.path=x/y", f"data.path={data}", f"data.masks={masks}",
                                "data.instance_prompt=a square"], check_paths=False)
    scan = training_scan(config)
    assert check_masks(config, scan) == []
    for item in scan.items:
        from_file = load_mask_tensor(item.path, str(masks), [scan.root], 32, crop="random", flip=True,
                                     rng=sample_rng(0, 0, 1))
        from_alpha = load_mask_tensor(item.path, "alpha", [], 32, crop="random", flip=True, rng=sample_rng(0, 0, 1))
        assert torch.equal(from_file, from_alpha)
    # kohya's layout: every mask at the top of the folder, by the image's name
    (masks / "2_sks square" / "a.png").rename(masks / "a.png")
    assert mask_file(scan.items[0].path, str(masks), [scan.root]) == masks / "a.png"
    (masks / "a.png").unlink()
    Image.new("L", (32, 64), 255).save(masks / "b.png")
    with pytest.raises(UserError, match=r"^data.masks: 2 of 2 images have no usable mask in .*a.png has none "
                                        r"\(expected .*a.png\); b.png is 32x64 but b.png is 64x64"):
        check_masks(config, scan)
    alpha = load_config(None, ["model.path=x/y", f"data.path={data}", "data.masks=alpha",
                               "data.instance_prompt=a square"], check_paths=False)
    Image.new("RGB", (64, 64)).save(data / "c.png")
    assert check_masks(alpha, training_scan(alpha)) == [
        "data.masks: 1 of 3 images have no alpha channel and train whole: c.png"]
    with pytest.raises(ConfigError, match="data.masks: folder '.*nowhere' does not exist"):
        load_config(None, ["model.path=x/y", f"data.path={data}", f"data.masks={tmp_path / 'nowhere'}"],
                    check_paths=True)


@pytest.fixture(scope="module")
def masked(tmp_path_factory, tiny_sd_path, tiny_sdxl_path, tiny_flux_path):
    """One family of each kind (loaded on first use) on the masked dataset, `data.masks: alpha`; SD and SDXL at
    zero terminal SNR, trained into v-prediction (one load each serves every test here)."""
    from trainer.families import get_family

    root = tmp_path_factory.mktemp("masked")
    data = masked_dataset(root / "data")
    snr = ["model.zero_terminal_snr=true", "model.prediction_type=v_prediction"]
    models = {"sd": (tiny_sd_path, snr), "sdxl": (tiny_sdxl_path, snr),
              "flux": (tiny_flux_path, ["flow.max_sequence_length=16"])}
    loaded = {}

    def family(name):
        if name not in loaded:
            model, extra = models[name]
            config = load_config(None, [f"model.path={model}", f"model.family={name}", f"data.path={data}",
                                        "precision=fp32", "devices=cpu:1", "batch.total=1", "batch.per_device=1",
                                        "data.resolution=64", "lora.rank=4", "data.masks=alpha", *extra])
            family = get_family(name)(_context(root / name, config)[0])
            family.load()
            family.prepare_data()
            family.set_prepared(family.trainable_modules())
            loaded[name] = family
        return loaded[name]

    return family


def _grads(family):
    return [p.grad for m in family.trainable_modules() for p in m.parameters() if p.requires_grad]


def _perturb_prediction(family, name, right: bool):
    """Make the family's prediction 100 larger on the right (or left) half of the latent's columns."""
    def shift(pred):
        pred, half = pred.clone(), pred.shape[-1] // 2
        pred[..., half:] += 100.0 if right else 0.0
        pred[..., :half] += 0.0 if right else 100.0
        return pred

    if name == "flux":
        forward = type(family).forward
        family.forward = lambda *args: shift(forward(family, *args))
    else:
        predict = type(family)._predict
        family._predict = lambda *args: shift(predict(family, *args))


@pytest.mark.parametrize("name", ["sd", "sdxl", "flux"])
def test_outside_the_mask_contributes_nothing(masked, name):
    family = masked(name)
    for module in family.trainable_modules():
        module.zero_grad(set_to_none=False)
    loss = family.loss([Sample(0, 0, 0)])  # img0: fully transparent
    loss.backward()
    grads = _grads(family)
    assert float(loss.detach()) == 0.0 and grads and all(torch.count_nonzero(g) == 0 for g in grads)

    with torch.no_grad():
        half, whole = family.loss([Sample(1, 0, 1)]), family.loss([Sample(2, 0, 2)])
        assert half > 0 and whole > 0
        _perturb_prediction(family, name, right=True)  # the right half of the latent: masked out
        try:
            assert torch.equal(family.loss([Sample(1, 0, 1)]), half)
            assert family.loss([Sample(2, 0, 2)]) > 100 * whole  # no alpha: trains whole, the error counts
        finally:
            family.__dict__.pop("forward", None), family.__dict__.pop("_predict", None)
        _perturb_prediction(family, name, right=False)
        try:
            assert family.loss([Sample(1, 0, 1)]) > 100 * half
        finally:
            family.__dict__.pop("forward", None), family.__dict__.pop("_predict", None)


# ---- train.loss ------------------------------------------------------------------------------------------------
def test_huber_and_l1_give_the_documented_values():
    pred = torch.tensor([[0.0, 0.05, -0.3, 2.0]])
    target = torch.zeros_like(pred)
    # by hand, delta 0.1: |e| <= 0.1 -> e^2; beyond -> 2 * 0.1 * |e| - 0.01
    assert Objective(loss="huber", huber_delta=0.1).error(pred, target)[0].tolist() == pytest.approx(
        [0.0, 0.0025, 0.05, 0.39])
    assert Objective(loss="l1").error(pred, target)[0].tolist() == pytest.approx([0.0, 0.05, 0.3, 2.0])
    assert Objective(loss="mse").error(pred, target)[0].tolist() == pytest.approx([0.0, 0.0025, 0.09, 4.0])
    # a mask weights elements, and the mean is over all of them: (0 + 0 + 0.3 + 2.0 * 0.5) / 4
    mask = torch.tensor([[[1.0, 0.0], [1.0, 0.5]]])
    per_sample = Objective(loss="l1").per_sample(pred.view(1, 1, 2, 2), target.view(1, 1, 2, 2), mask[None])
    assert per_sample.tolist() == pytest.approx([1.3 / 4])


@pytest.mark.parametrize("name", ["sd", "sdxl", "flux"])
def test_the_loss_choice_reaches_every_family(masked, name):
    family = masked(name)
    train, samples = family.cfg.train, [Sample(2, 0, 2)]  # img2: no mask
    losses = {}
    try:
        with torch.no_grad():
            for loss, delta in (("mse", 0.1), ("huber", 1e6), ("huber", 1e-6), ("l1", 0.1)):
                train.loss, train.huber_delta = loss, delta
                losses[loss, delta] = float(family.loss(samples))
    finally:
        train.loss, train.huber_delta = "mse", 0.1
    assert losses["huber", 1e6] == losses["mse", 0.1]  # every error below delta: the squared error itself
    assert losses["huber", 1e-6] == pytest.approx(2e-6 * losses["l1", 0.1] - 1e-12, rel=1e-3)  # all beyond it
    assert losses["l1", 0.1] != pytest.approx(losses["mse", 0.1], rel=1e-2)


# ---- train.input_perturbation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sd", "flux"])
def test_input_perturbation_adds_the_samples_next_noise_draw_to_the_input_only(masked, name, monkeypatch):
    from trainer.core.data.stream import position_seed
    from trainer.families.components import flow_matching as fm
    from trainer.families.components import noise as diffusion
    from trainer.families.components.captioned import torch_generator

    family = masked(name)
    inputs, targets = [], []
    if name == "flux":
        forward = type(family).forward
        family.forward = lambda model, noisy, *rest: (inputs.append(noisy), forward(family, model, noisy, *rest))[1]
        noisy_and_target = fm.noisy_and_target
        monkeypatch.setattr(fm, "noisy_and_target", lambda *a: (lambda out: (targets.append(out[1]), out)[1])(
            noisy_and_target(*a)))
    else:
        predict = type(family)._predict
        family._predict = lambda noisy, *rest: (inputs.append(noisy), predict(family, noisy, *rest))[1]
        target_for = diffusion.target_for
        monkeypatch.setattr(diffusion, "target_for", lambda *a: (lambda out: (targets.append(out), out)[1])(
            target_for(*a)))
    try:
        with torch.no_grad():
            for gamma in (0.0, 0.5):
                family.cfg.train.input_perturbation = gamma
                family.loss([Sample(3, 0, 2)])
    finally:
        family.cfg.train.input_perturbation = 0.0
        family.__dict__.pop("forward", None), family.__dict__.pop("_predict", None)
    # replay the sample's own generator: its draws, then the perturbation's
    data = family.flow.data if name == "flux" else family.data
    mean, _ = data.latent_dist(2, 0, 2, "instance")
    gen = torch_generator(position_seed(0, 3, 0))
    if name == "flux":
        flow = family.cfg.flow
        _, sigma, _ = fm.draw_sample(gen, tuple(mean.shape), scheme=flow.timestep_sampling, logit_mean=flow.logit_mean,
                                     logit_std=flow.logit_std, shift=family.shift(tuple(mean.shape)))
        scale = sigma
    else:
        d = diffusion.draw(gen, tuple(mean.shape), num_timesteps=1000, noise_offset=0.0)
        scale = float((1 - family.noise_scheduler.alphas_cumprod[d.timestep]) ** 0.5)
    xi = torch.randn(tuple(mean.shape), generator=gen)
    torch.testing.assert_close(inputs[1] - inputs[0], (scale * 0.5 * xi)[None], rtol=1e-4, atol=1e-5)
    assert torch.equal(targets[0], targets[1])
    noise = torch.ones(3)
    assert torch.equal(Objective(input_perturbation=0.5).input_noise(gen, noise, training=False), noise)  # val rows


# ---- model.zero_terminal_snr ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sd", "sdxl"])
def test_zero_terminal_snr_ends_the_schedule_at_pure_noise_everywhere_the_model_goes(masked, name):
    from diffusers import DDPMScheduler

    from trainer.families.components import noise as diffusion

    family = masked(name)
    alphas = family.noise_scheduler.alphas_cumprod
    assert alphas[-1] == 0 and alphas[-2] > 0
    original = {k: v for k, v in family.scheduler_config.items() if k not in ("rescale_betas_zero_snr",)}
    assert DDPMScheduler.from_config(original).alphas_cumprod[-1] > 0  # what the flag changes
    x0, noise = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    last = torch.tensor([len(alphas) - 1])
    # at the last timestep the input is pure noise and the v target is the image itself (negated)
    torch.testing.assert_close(family.noise_scheduler.add_noise(x0, noise, last), noise)
    torch.testing.assert_close(diffusion.target_for(family.noise_scheduler, x0, noise, last, "v_prediction"), -x0)
    sampler = family.pipeline().scheduler  # samples and a full fine-tune's saved scheduler
    assert sampler.config.rescale_betas_zero_snr and sampler.config.timestep_spacing == "trailing"
    assert float(sampler.alphas_cumprod[-1]) == 2**-24  # diffusers' samplers keep it just above 0
    assert sampler.config.prediction_type == "v_prediction"


def test_zero_terminal_snr_refuses_an_epsilon_model(tmp_path, tiny_sd_path, tiny_flux_path):
    from trainer.families import get_family

    overrides = [f"model.path={tiny_sd_path}", f"data.path={masked_dataset(tmp_path / 'data')}",
                 "devices=cpu:1", "batch.total=1", "model.zero_terminal_snr=true"]
    config = load_config(None, overrides)  # auto: the model's scheduler says epsilon, known once it is loaded
    with pytest.raises(UserError, match=r"^model.zero_terminal_snr needs a v-prediction model, and this one "
                                        r"predicts epsilon .* set model.zero_terminal_snr=false"):
        get_family("sd")(_context(tmp_path, config)[0]).load()
    with pytest.raises(ConfigError, match="model.zero_terminal_snr: needs v-prediction, and model.prediction_type "
                                          "is epsilon"):
        load_config(None, [*overrides, "model.prediction_type=epsilon"])
    with pytest.raises(ConfigError, match="model.zero_terminal_snr: is for the UNet families' DDPM noise schedule; "
                                          "flux trains by flow matching"):
        load_config(None, [*overrides, "model.family=flux", f"model.path={tiny_flux_path}"])


def test_detection_refuses_every_diffusion_only_key():
    from trainer.families.detection.checks import DIFFUSION_ONLY

    values = {"data.caption_prefix": "sks", "data.caption_dropout": 0.1, "data.shuffle_tags": True,
              "data.keep_tokens": 1, "data.masks": "alpha", "train.loss": "l1", "train.huber_delta": 0.5,
              "train.input_perturbation": 0.1, "train.noise_offset": 0.05, "train.min_snr_gamma": 5.0,
              "model.zero_terminal_snr": True, "data.datasets": "[{path: x}]", "train.text_encoder_lr": 1e-5}
    assert set(values) == set(DIFFUSION_ONLY)
    for key, value in values.items():
        with pytest.raises(ConfigError) as refused:
            load_config(None, ["model.family=detection", "model.path=fcos_tiny", "method=full",
                               "detection.weights=none", "data.path=x.json", f"{key}={value}"], check_paths=False)
        assert [p for p in refused.value.problems if p.startswith(f"{key}: not for detection: ")], key


# ---- through the launcher ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["demo.yaml", "demo-sdxl.yaml", "demo-flux.yaml"])
def test_the_demo_preset_trains_three_steps_with_every_new_key_at_once(preset, tmp_path):
    """A family's demo preset offline on the CPU with caption augmentation, folder masks, huber, input
    perturbation, a LoKr with its average (lora.ema) and, for the UNet families, zero terminal SNR (the demo's
    epsilon base trained into v-prediction): one launched run per family; its LoKr file is written."""
    from tests.engine_helpers import launch, log_of, progress
    from trainer.core.assets import resolve_paths
    from trainer.core.data.scan import IMAGE_EXTENSIONS

    preset = Path(__file__).parent.parent / "presets" / preset
    overrides = ["devices=cpu:1", "train.steps=3", "train.warmup_steps=0", "sample.every=0", "sample.steps=2",
                 "sample.images_per_prompt=1", "checkpoint.every=0", "data.caption_prefix=sks,",
                 "data.caption_dropout=0.25", "data.shuffle_tags=true", "data.keep_tokens=1", "train.loss=huber",
                 "train.huber_delta=0.2", "train.input_perturbation=0.1", "lora.type=lokr", "lora.factor=4",
                 "lora.ema=true", "lora.ema_decay=0.5", "lora.train_text_encoder=false"]
    if "flux" not in preset.name:
        overrides += ["model.zero_terminal_snr=true", "model.prediction_type=v_prediction"]
    data = Path(resolve_paths(load_config(preset, overrides), tmp_path).data.path)  # builds the demo data here
    masks = tmp_path / "masks"
    masks.mkdir()
    for image in sorted(p for p in data.iterdir() if p.suffix in IMAGE_EXTENSIONS):
        with Image.open(image) as img:
            mask = Image.new("L", img.size, 0)
        mask.paste(255, (img.width // 4, img.height // 4, 3 * img.width // 4, 3 * img.height // 4))
        mask.save(masks / f"{image.stem}.png")
    run_dir, final = launch(tmp_path, load_config(preset, [*overrides, f"data.masks={masks}"]))
    assert final["type"] == "done", log_of(run_dir)
    losses = [e["loss"] for e in progress(run_dir)]
    assert len(losses) == 3 and all(loss is not None and loss > 0 for loss in losses)
    log = log_of(run_dir)
    assert "Traceback" not in log
    assert any(p.name.endswith("_kohya.safetensors") for p in (run_dir / "output").iterdir())
