"""The validation loss of the diffusion families (`data.val_split`, `data.val_path`, `val_loss`, `eval.best`).

Held-out images are never trained on (the split is by image, seeded, the same for any number of processes, and
the stream never reaches one); bad values are refused with a sentence naming the key; each held-out image has the
same draws at every evaluation, and the ranks' shares add up exactly to one process's losses; checkpoints/best/
keeps the lowest; SDXL and FLUX report it too, from their text caches; the UI draws it next to the training loss.
The launched test compares 1 and 2 processes and a stop + resume through torchrun.
"""

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image, ImageDraw

from tests.engine_helpers import engine_config, launch, log_of
from tests.test_captioned_latents import _VAE, _Accelerator
from trainer.core.config import load_config
from trainer.core.data.holdout import held_out_count, training_scan
from trainer.core.data.stream import BatchStream
from trainer.core.events import read_events
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.errors import ConfigError, UserError
from trainer.families.protocol import WorkerContext, evaluator_of


def _images(folder: Path, names, size=(64, 64), caption="a photo of a red circle") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n, name in enumerate(names):
        img = Image.new("RGB", size, (235, 235, 235))
        ImageDraw.Draw(img).ellipse((4 + 2 * n, 8, size[0] - 8, size[1] - 4), fill=(200, 40 + 10 * n, 40))
        img.save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"{caption} {name}")
    return folder


@pytest.fixture
def folder(tmp_path):
    """Ten images at the top and two in a kohya folder of 3 repeats."""
    root = _images(tmp_path / "data", [f"img{n}" for n in range(10)])
    _images(root / "3_sks dog", ["dog0", "dog1"])
    return root


def _config(data, *overrides, check_paths=True):
    # model.path: any folder that exists (nothing here loads a model)
    return load_config(None, [f"model.path={Path(data).parent}", f"data.path={data}", "data.resolution=64", *overrides],
                       check_paths=check_paths)


# ---- the split ---------------------------------------------------------------------------------------------------
def test_the_split_is_by_image_and_seeded_and_the_stream_never_reaches_a_held_out_image(folder):
    scan = training_scan(_config(folder, "data.val_split=0.25"))
    held = {item.path for item in scan.held_out}
    assert len(held) == held_out_count(12, 0.25) == 3 and len(scan.items) == 9
    assert held.isdisjoint(item.path for item in scan.items)
    assert scan.expanded_count == sum(item.repeats for item in scan.items)  # a held-out image takes its repeats
    again = training_scan(_config(folder, "data.val_split=0.25"))
    assert [i.path for i in again.held_out] == [i.path for i in scan.held_out]  # deterministic
    others = [{i.path for i in training_scan(_config(folder, "data.val_split=0.25", f"seed={s}")).held_out}
              for s in range(1, 4)]
    assert any(o != held for o in others)  # the seed chooses
    # the split knows nothing of processes: 1 and 2 of them walk the same training items, never a held-out one
    expanded = scan.expanded()
    for world, per_device in ((1, 4), (2, 2)):
        stream = BatchStream(len(expanded), total=4, per_device=per_device, world_size=world, seed=0)
        seen = {expanded[stream.item(p)[1]].path for step in range(12) for micro in range(stream.accumulation)
                for rank in range(world) for p in stream.positions(step, micro, rank)}
        assert seen == {item.path for item in scan.items}
    # a val_path folder is held out whole; data.path trains in full
    val = _images(folder.parent / "val", ["v0", "v1"])
    whole = training_scan(_config(folder, f"data.val_path={val}"))
    assert len(whole.items) == 12 and [Path(i.path).name for i in whole.held_out] == ["v0.png", "v1.png"]


def test_bad_values_are_refused_with_a_sentence_naming_the_key(folder, tmp_path):
    def problems(*overrides, family="sd"):
        try:
            _config(folder, f"model.family={family}", *overrides, check_paths=False)
        except ConfigError as exc:
            return exc.problems
        return []

    assert problems("data.val_split=0.1") == []
    for bad in ("1.0", "-0.1"):
        assert any(p.startswith("data.val_split: must be a fraction in [0, 1)") for p in problems(f"data.val_split={bad}"))
    both = problems("data.val_split=0.1", f"data.val_path={tmp_path}")
    assert any(p.startswith("data.val_path: data.val_split is set too") for p in both)
    assert any(p.startswith("eval.best: val_loss needs held-out images") for p in problems("eval.best=val_loss"))
    with pytest.raises(ConfigError, match="data.val_path: folder .* does not exist"):
        _config(folder, f"data.val_path={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="data.val_path: is data.path itself"):
        _config(folder, f"data.val_path={folder}")
    detection = problems("model.path=fcos_tiny", "method=full", "data.val_split=0.2", "eval.best=val_loss",
                         family="detection")
    assert any(p.startswith("data.val_split: detection evaluates on its own validation set") for p in detection)
    assert any(p.startswith("eval.best: val_loss is the diffusion families'") for p in detection)
    # what only the images can tell, the data check says before anything starts
    one = _images(tmp_path / "one", ["only"])
    with pytest.raises(UserError, match=r"^data.val_split: 0.5 of the 1 usable image in .* leaves none to train on"):
        training_scan(_config(one, "data.val_split=0.5"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="^data.val_path: no images"):
        training_scan(_config(one, f"data.val_path={tmp_path / 'empty'}"))


def test_the_plan_counts_the_held_out_images_and_val_path_is_a_confined_path(folder, tmp_path):
    from app.security import Workspace
    from trainer.core.assets import resolve_paths
    from trainer.core.family_spec import check_captioned_images

    config = _config(folder, "data.val_split=0.25", "devices=cpu:1", "batch.total=2")
    plan = make_plan(config, CPU_ONLY).with_held_out(check_captioned_images(config))
    assert plan.val_images == 3 and plan.line().endswith("· val_loss on 3 held-out images")
    assert plan.event()["val_images"] == 3
    assert make_plan(config, CPU_ONLY).with_held_out(None).val_images == 0

    val = _images(tmp_path / "val", ["v0"])
    relative = _config(folder, f"data.val_path={Path('val')}", check_paths=False)
    assert resolve_paths(relative, tmp_path / "runs").data.val_path == str(Path("val").resolve())
    confined = Workspace(folder, confined=True)
    refused = confined.built_problems(_config(folder, f"data.val_path={val}"))
    assert any(p.startswith("data.val_path:") and "outside the workspace" in p for p in refused)


# ---- the held-out rows -------------------------------------------------------------------------------------------
def test_held_out_latents_are_center_cropped_unflipped_and_cached_like_training_ones(tmp_path):
    data = _images(tmp_path / "data", ["a", "b", "c"], size=(96, 64))

    def latents(*overrides):
        from trainer.families.components.captioned_latents import CaptionedLatents

        config = load_config(None, ["model.path=stand-in/model", f"data.path={data}", "data.resolution=32",
                                    "precision=fp32", "devices=cpu:1", "batch.total=2", "data.val_split=0.34",
                                    "data.flip=true", *overrides], check_paths=False)
        ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                            torch.device("cpu"), 0, 1, _Accelerator(), lambda _: None)
        out = CaptionedLatents(ctx, _VAE())
        assert out.prepare() == 2 and len(out.held_out) == 1  # an epoch is the training images only
        return out

    from trainer.families.components.captioned import load_image_tensor

    cached, uncached = latents(), latents("data.cache_latents=false", "data.center_crop=false")
    assert cached.held_out_latents is not None and uncached.held_out_latents is None
    expected = _VAE().encode(load_image_tensor(cached.held_out[0].path, 32, crop="center")[None]).latent_dist.mean[0]
    for source in (cached, uncached):
        for epoch in range(4):  # never flipped or moved, whatever the seed would draw for training
            torch.testing.assert_close(source.latent_dist(0, epoch, 0, "val")[0], expected)
    assert cached.caption(0, "val") == cached.held_out[0].caption and cached.center_cropped("val")
    assert set(cached.captions()) == {i.caption for i in cached.images + cached.held_out}


def _family(tmp_path, name, model, data, *overrides, make=None):
    from trainer.families import get_family

    config = load_config(None, [f"model.path={model}", f"model.family={name}", f"data.path={data}", "precision=fp32",
                                "devices=cpu:1", "batch.total=2", "batch.per_device=2", "data.resolution=64",
                                "lora.rank=4", "lora.alpha=8", "data.flip=true", *overrides])
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), lambda _: None)
    family = get_family(name)(ctx)
    family.load()
    family.prepare_data()
    family.set_prepared(family.trainable_modules())
    return family


def test_sd_val_loss_has_the_same_draws_at_every_evaluation_and_the_ranks_add_up_exactly(
        tmp_path, tiny_sd_path, demo_data_path):
    from trainer.families.components.validation import HeldOutLoss, held_out_loss

    family = _family(tmp_path, "sd", tiny_sd_path, demo_data_path, "data.val_split=0.25", "lora.dropout=0.5")
    evaluator = evaluator_of(family)
    assert isinstance(evaluator, HeldOutLoss) and (evaluator.best_metric, evaluator.best_mode) == ("val_loss", "min")
    without = dataclasses.replace(family.ctx, config=load_config(None, [f"model.path={tiny_sd_path}",
                                                                        f"data.path={demo_data_path}"]))
    assert held_out_loss(without, family.data, evaluator.rows_loss, evaluator.modules) is None  # no eval, as before
    held = {i.path for i in family.data.held_out}
    assert len(held) == 4 and held.isdisjoint(i.path for i in family.data.images)
    assert len(family.data.latents["mean"]) == len(family.data.images)  # the training cache: training images only

    first = evaluator.evaluate(step=1)
    assert first["val_images"] == 4 and math.isfinite(first["val_loss"])
    assert family.unet.training  # train mode restored (dropout was off while evaluating: the draws repeat exactly)
    whole = evaluator.local_losses()  # a second evaluation, at another step: the same draws, the same losses
    assert math.fsum(whole.tolist()) / 4 == first["val_loss"]

    # every rank computes its own micro-batches (a rank without one drops a padding image): they add up exactly
    parts = [HeldOutLoss(dataclasses.replace(family.ctx, rank=r, world_size=3), family.data, evaluator.rows_loss,
                         evaluator.modules).local_losses() for r in range(3)]
    assert torch.equal(sum(parts), whole) and [int((p != 0).sum()) for p in parts] == [2, 2, 0]

    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.SGD(params, lr=10.0)
    family.loss([(0, 0, 0), (1, 0, 1)]).backward()
    optimizer.step()
    assert evaluator.evaluate(step=8)["val_loss"] != first["val_loss"]  # it measures the weights


@pytest.mark.parametrize("name", ["sdxl", "flux"])
def test_sdxl_and_flux_report_val_loss_from_their_text_caches(tmp_path, tiny_sdxl_path, tiny_flux_path, name):
    data = _images(tmp_path / "data", ["a", "b", "c"])
    val = _images(tmp_path / "val", ["wide"], size=(96, 48), caption="a green triangle")
    _images(val, ["square"], caption="a green triangle")
    extra = ["flow.max_sequence_length=16"] if name == "flux" else []
    family = _family(tmp_path, name, tiny_sdxl_path if name == "sdxl" else tiny_flux_path, data, *extra,
                     f"data.val_path={val}", "data.bucketing=true", "data.bucket_step=16")
    parts = getattr(family, "flow", family)
    cache = parts.text_cache if name == "flux" else parts.text_embeddings
    assert cache is not None and "a green triangle square" in cache  # held-out captions were cached with the rest
    assert parts.data.held_out_latents is not None and len(parts.data.images) == 3
    encoders = parts.text_encoders if name == "flux" else [parts.text_encoder, parts.text_encoder_2]
    calls = []
    for encoder in encoders:
        encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    evaluator = evaluator_of(family)
    assert [len(b) for b in evaluator.batches()] == [1, 1]  # one shape per micro-batch: its own bucket each
    first = evaluator.evaluate(step=2)
    assert first["val_images"] == 2 and math.isfinite(first["val_loss"]) and calls == []
    assert evaluator.evaluate(step=4) == first


# ---- the best checkpoint -----------------------------------------------------------------------------------------
def test_the_best_checkpoint_keeps_the_lowest_val_loss(tmp_path):
    from trainer.engine.run_io import keep_best, read_best

    events = []
    evaluator = SimpleNamespace(best_metric="val_loss", best_mode="min")
    run = SimpleNamespace(
        family=SimpleNamespace(evaluator=evaluator, trainable_state=lambda: {"w": torch.full((2,), float(run.state.step))}),
        config=SimpleNamespace(eval=SimpleNamespace(best="auto")), run_dir=tmp_path, state=SimpleNamespace(step=0),
        events=SimpleNamespace(emit=lambda event: events.append(event.to_dict())))
    for step, value in ((1, 0.5), (2, 0.4), (3, 0.45), (4, 0.3), (5, 0.3)):
        run.state.step = step
        keep_best(run, {"val_loss": value, "val_images": 4})
    assert [(e["step"], e["value"], e["mode"]) for e in events] == [(1, 0.5, "min"), (2, 0.4, "min"), (4, 0.3, "min")]
    assert read_best(tmp_path) == {"step": 4, "metric": "val_loss", "value": 0.3, "mode": "min"}
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "checkpoints" / "best" / "trainable.safetensors"))["w"].tolist() == [4.0, 4.0]
    run.config.eval.best = "none"
    run.state.step = 6
    keep_best(run, {"val_loss": 0.1})
    assert read_best(tmp_path)["step"] == 4  # eval.best: none keeps nothing
    evaluator.best_metric, evaluator.best_mode, run.config.eval.best = "map", "max", "auto"
    for step, value in ((7, 0.2), (8, 0.1), (9, 0.3)):  # detection's mAP: higher is better (a new metric replaces)
        run.state.step = step
        keep_best(run, {"map": value})
    assert read_best(tmp_path)["step"] == 9 and [e["step"] for e in events[3:]] == [7, 9]


# ---- the UI ------------------------------------------------------------------------------------------------------
def test_the_ui_draws_val_loss_with_the_training_loss_and_every_score_on_the_evaluation_plot(tmp_path):
    from app import ui_runs
    from app.runs import EventCache, eval_losses, eval_series, read_run
    from tests.test_app import PLAN, progress, write_run

    run = write_run(tmp_path, "val", [PLAN, progress(1, 0.9), progress(2, 0.7),
                                      {"type": "eval", "step": 2, "concept": 0.25},  # the sample step's scores
                                      {"type": "eval", "step": 2, "val_loss": 0.61234, "val_images": 4},
                                      {"type": "best", "step": 2, "metric": "val_loss", "value": 0.61234,
                                       "mode": "min", "path": "checkpoints/best"}])
    view = read_run(run, EventCache())
    assert eval_losses(view) == [(2, "val loss", 0.61234)]
    assert eval_series(view) == [(2, "concept score", 0.25)]  # the loss is not drawn among the 0..1 scores
    frame = ui_runs._loss_frame(dict(view.losses), eval_losses(view))
    assert sorted(set(frame["series"])) == ["per step", "smoothed", "val loss"]
    box = ui_runs.eval_html(view)
    assert "on 4 held-out images" in box and "val loss <b>0.6123</b> · concept score <b>0.250</b>" in box
    assert "Best so far: step <b>2</b> (val loss 0.6123)" in box


# ---- through the launcher ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_val_loss_is_the_same_on_one_and_two_processes_and_after_a_resume(tmp_path, tiny_sd_path, demo_data_path):
    from trainer.core.resume import resume_run

    def evals(run_dir):
        return {e["step"]: e for e in read_events(run_dir) if e["type"] == "eval"}

    common = ["data.val_split=0.25", "eval.every=1", "batch.per_device=2"]
    one, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "name=one", *common))
    assert final["type"] == "done", log_of(one)
    assert read_events(one)[0]["line"].endswith("· val_loss on 4 held-out images")
    two, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, "devices=cpu:2", "name=two", *common),
                        fault="stop_at_step=2")
    assert final["type"] == "stopped", log_of(two)
    final = resume_run(two, ["devices=cpu:1"], hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(two)

    a, b = evals(one), evals(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and {e["val_images"] for e in [*a.values(), *b.values()]} == {4}
    for step in a:  # 2 processes for steps 1-2, then resumed on 1: the weights agree to DDP's rounding
        assert b[step]["val_loss"] == pytest.approx(a[step]["val_loss"], rel=1e-6)
    lowest = min(a, key=lambda s: (a[s]["val_loss"], s))
    bests = [e for e in read_events(one) if e["type"] == "best"]
    assert bests[-1]["step"] == lowest and all(e["metric"] == "val_loss" for e in bests)
    assert all(later["value"] < earlier["value"] for earlier, later in zip(bests, bests[1:]))
