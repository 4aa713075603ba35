"""What every flow-matching family's tests check through the real launcher, written once: a tiny model trained
4 steps from its demo preset (fp32, batch 2, no samples) is the reference; a run stopped at step 2 and resumed on
2 processes x 1 per device gives the reference's losses and weights; the LoRA file loads back through the family's pipeline with exactly the trained weights.
Each family's test module imports the `data` and `runs` fixtures and keeps its own model fixtures and
model-specific checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_helpers import assert_lora_loaded, assert_same_weights, final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.core.hardware import CPU_ONLY
from trainer.core.resume import resume_run

RUN = ("precision=fp32", "batch.total=2", "train.steps=4", "train.lr=1e-3", "train.warmup_steps=0",
       "sample.every=0", "checkpoint.every=0")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo's shapes, 4 images: what every family's launcher runs train on."""
    from trainer.families.sd.demo import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("flow-data") / "data", count=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("flow-runs")


def flow_config(preset: Path, model: Path, data: Path, *overrides: str):
    return load_config(preset, [f"model.path={model}", f"data.path={data}", *RUN, *overrides])


def train(runs: Path, preset: Path, model: Path, data: Path, *overrides: str, fault: str | None = None) -> Path:
    """A run to its end (`stopped` with a fault, else `done`); its folder."""
    run_dir, final = launch(runs, flow_config(preset, model, data, *overrides), fault=fault)
    assert final["type"] == ("stopped" if fault else "done"), log_of(run_dir)
    return run_dir


def reference(runs: Path, preset: Path, model: Path, data: Path, *overrides: str) -> Path:
    return train(runs, preset, model, data, "devices=cpu:1", "batch.per_device=2", "name=ref", *overrides)


def assert_resumed_on_two_processes_matches(ref: Path, runs: Path, preset: Path, model: Path, data: Path,
                                            *overrides: str) -> None:
    """Stopped at step 2 on 1 process, resumed on 2 processes x 1 per device: the uninterrupted 1-process run's
    losses and weights. One run proves both that a resume is exact and that DDP's averaged gradients are one
    process's (as tests/test_engine.py does for SD)."""
    run_dir = train(runs, preset, model, data, "devices=cpu:1", "batch.per_device=2", "name=stopped", *overrides,
                    fault="stop_at_step=2")
    final = resume_run(run_dir, ["devices=cpu:2", "batch.per_device=1"], hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    assert [e["step"] for e in progress(run_dir)] == [1, 2, 3, 4], "no step repeated or skipped"
    assert [e["loss"] for e in progress(ref)] == pytest.approx([e["loss"] for e in progress(run_dir)], rel=1e-5)
    assert_same_weights(final_weights(ref), final_weights(run_dir))


def assert_lora_loads_back(pipeline_class, model: Path, run_dir: Path) -> None:
    """`pipeline_class.load_lora_weights(output/)` holds exactly the run's trained weights."""
    loaded = pipeline_class.from_pretrained(model)
    loaded.load_lora_weights(run_dir / "output")
    assert_lora_loaded(loaded, final_weights(run_dir))
