"""FSDP full fine-tunes through the real launcher on a tiny FLUX.1 transformer (2 CPU processes on gloo):

SGD with momentum, not Adam: Adam is blind to the scale of the gradients (a sum where a mean belongs would pass)
and turns rounding-level differences of near-zero gradients into lr-sized steps; SGD's update is the gradient.

- 2 processes sharded with FSDP2 train the same weights as 1 unsharded process, step by step, with samples
  drawn from the gathered weights on the way (rank 0 alone, no deadlock) and not drawn in the reference;
- a checkpoint written under FSDP resumes on 1 unsharded process (checkpoints hold full tensors in one
  format) and ends where the uninterrupted run does;
- the output folder loads with FluxPipeline.from_pretrained and holds the trained weights.
"""

import pytest

from tests.engine_helpers import BASE, assert_same_weights, final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.core.hardware import CPU_ONLY
from trainer.core.resume import resume_run

pytestmark = pytest.mark.slow

FULL = [*BASE, "model.family=flux", "method=full", "full.ema=false", "batch.total=4", "train.steps=3",
        "train.optimizer=sgd", "train.lr=0.02", "train.warmup_steps=0", "train.scheduler=constant", "flow.max_sequence_length=16",
        "data.flip=false", "sample.size=64", "sample.steps=2", "full.save_single_file=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_flux_path):
    from trainer.families.sd.demo import make_demo_dataset

    return tiny_flux_path, make_demo_dataset(tmp_path_factory.mktemp("fsdp-data"), count=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp-runs")


def _config(assets, *extra):
    model, data = assets
    return load_config(None, [f"model.path={model}", f"data.path={data}", *FULL, *extra])


@pytest.fixture(scope="module")
def reference(runs, assets):
    """1 process x 2 per device x accumulation 2, unsharded, no samples."""
    run_dir, final = launch(runs, _config(assets, "devices=cpu:1", "batch.per_device=2", "sample.prompts=[]",
                                          "distributed.sharding=ddp", "name=reference"))
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


def test_fsdp_on_two_processes_matches_one_unsharded_process(reference, runs, assets):
    config = _config(assets, "devices=cpu:2", "batch.per_device=1", "distributed.sharding=fsdp", "sample.every=1",
                     "sample.prompts=[a red circle]", "name=fsdp")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    plan = read_events(run_dir)[0]
    assert (plan["world_size"], plan["accumulation"], plan["sharding"]) == (2, 2, "fsdp")
    assert "· fsdp ·" in plan["line"]
    # every trained tensor, gathered from the shards into the checkpoint, equals the unsharded run's
    reference_weights = final_weights(reference)
    assert len(reference_weights) > 20  # the whole transformer, not an adapter
    from diffusers import FluxTransformer2DModel

    initial = FluxTransformer2DModel.from_pretrained(assets[0] / "transformer").state_dict()
    moved = max((reference_weights[f"transformer.{k}"] - v.float()).abs().max().item() for k, v in initial.items())
    assert moved > 1e-3, "the runs must train visibly for the comparison to mean anything"
    assert_same_weights(reference_weights, final_weights(run_dir))
    assert [e["loss"] for e in progress(reference)] == pytest.approx([e["loss"] for e in progress(run_dir)], rel=1e-5)
    samples = [e for e in read_events(run_dir) if e["type"] == "sample"]
    assert [e["step"] for e in samples] == [0, 1, 2, 3]  # rank 0 drew from the gathered weights, others waited

    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(run_dir / "output" / "diffusers")
    saved = {f"transformer.{k}": v for k, v in pipe.transformer.state_dict().items()}
    assert_same_weights(final_weights(run_dir), {k: saved[k].float() for k in final_weights(run_dir)})


def test_an_fsdp_checkpoint_resumes_unsharded_on_one_process(reference, runs, assets):
    # One step under FSDP, then extended to the reference's 3 steps on one unsharded process (a finished run
    # resumes from its final checkpoint; the constant schedule makes that the uninterrupted run). Deterministic,
    # unlike a Stop request racing a 3-step run; Stop itself is the engine's and is tested in test_engine.
    config = _config(assets, "devices=cpu:2", "batch.per_device=1", "distributed.sharding=fsdp", "train.steps=1",
                     "sample.prompts=[]", "name=fsdp-then-ddp")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done" and final["step"] == 1, log_of(run_dir)

    resumed = resume_run(run_dir, ["devices=cpu:1", "distributed.sharding=ddp", "train.steps=3"], hw=CPU_ONLY)
    final = resumed.wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    assert [e["step"] for e in progress(run_dir)] == [1, 2, 3]
    # the momentum buffers came back from the FSDP checkpoint: otherwise the next steps would differ
    assert_same_weights(final_weights(reference), final_weights(run_dir))


def test_sd_full_finetune_with_its_text_encoder_under_fsdp_matches_one_process(runs, tiny_sd_path, demo_data_path):
    """The UNet family: two sharded modules (UNet and text encoder, one optimizer over both, two learning rates)."""
    common = [f"model.path={tiny_sd_path}", f"data.path={demo_data_path}", *BASE, "method=full", "full.ema=false",
              "full.train_text_encoder=true", "train.text_encoder_lr=0.01", "full.save_single_file=false",
              "batch.total=4", "train.steps=2", "train.optimizer=sgd", "train.lr=0.02", "train.warmup_steps=0",
              "train.scheduler=constant", "sample.prompts=[]"]
    one_dir, one = launch(runs, load_config(None, [*common, "devices=cpu:1", "batch.per_device=4",
                                                    "distributed.sharding=ddp", "name=sd-one"]))
    two_dir, two = launch(runs, load_config(None, [*common, "devices=cpu:2", "batch.per_device=1",
                                                    "distributed.sharding=fsdp", "name=sd-fsdp"]))
    assert one["type"] == "done", log_of(one_dir)
    assert two["type"] == "done", log_of(two_dir)
    weights = final_weights(one_dir)
    assert any(k.startswith("text_encoder.") for k in weights) and any(k.startswith("unet.") for k in weights)
    assert_same_weights(weights, final_weights(two_dir))
    assert (two_dir / "output" / "diffusers" / "unet").is_dir()
