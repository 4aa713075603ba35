"""Outputs from any checkpoint: `launch.py --export RUN [--step N]` and `checkpoint.export`, on the demo preset
through the real command line. A stopped run's export loads into diffusers; a finished run's export of its last
checkpoint holds the tensors of its own output/; bad input is one paragraph and exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine_helpers import assert_lora_loaded
from trainer.core.events import read_events
from trainer.core.outputs import exported_steps, label
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
# sample.every=0 still draws at the start and the end (schema: "0: only at the start and the end"); the demo's
# 2 prompts x 4 images x 20 denoising steps cost ~4 s a draw on one core, so one image at 2 steps each.
DEMO = ["train.steps=4", "sample.every=0", "sample.steps=2", "sample.images_per_prompt=1", "batch.total=2",
        "batch.per_device=2", "train.warmup_steps=1"]


def cli(*args: str, fault: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IMAGETUNE_FAULT"}
    if fault:
        env["IMAGETUNE_FAULT"] = fault
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A demo run to the end with `checkpoint.export`: step 2's outputs mid-run, output/ at step 4."""
    runs = tmp_path_factory.mktemp("runs")
    done = cli("--preset", "demo", "--runs-dir", str(runs), *DEMO, "checkpoint.every=2", "checkpoint.export=true")
    assert done.returncode == 0, done.stdout + done.stderr
    return runs / "demo"


@pytest.mark.slow
def test_checkpoint_export_writes_the_outputs_of_every_checkpoint(finished):
    assert exported_steps(finished) == [2]  # step 4's outputs are the run's own, in output/
    exports = [e for e in read_events(finished) if e["type"] == "export"]
    assert [e["step"] for e in exports] == [2]
    kinds = {label(p).split(":")[0] for p in exports[0]["outputs"]}
    assert kinds == {"diffusers", "ComfyUI / A1111 / Forge"}
    for path in exports[0]["outputs"]:
        assert (finished / path).is_file() and path.startswith("output/step-000002/")
    # the export is of step 2's weights: not those of the end
    step2 = load_file(str(finished / "output/step-000002/pytorch_lora_weights.safetensors"))
    end = load_file(str(finished / "output/pytorch_lora_weights.safetensors"))
    assert step2.keys() == end.keys()
    assert any(not torch.equal(step2[k], end[k]) for k in step2)


@pytest.mark.slow
def test_export_of_the_last_checkpoint_matches_the_finished_runs_outputs(finished):
    out = cli("--export", str(finished), "--step", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "output/step-000004/pytorch_lora_weights.safetensors  <- diffusers: pipe.load_lora_weights" in out.stdout
    assert "_kohya.safetensors  <- ComfyUI / A1111 / Forge" in out.stdout
    for own in (finished / "output").glob("*.safetensors"):
        exported = load_file(str(finished / "output/step-000004" / own.name))
        expected = load_file(str(own))
        assert exported.keys() == expected.keys() and expected
        for key in expected:
            assert torch.equal(exported[key], expected[key]), f"{own.name}: {key}"
    assert sorted(p.name for p in (finished / "output/step-000004").iterdir()) == sorted(
        p.name for p in (finished / "output").iterdir() if p.is_file())


@pytest.mark.slow
def test_a_stopped_run_exports_a_lora_that_diffusers_loads(tmp_path):
    runs = tmp_path / "runs"
    stopped = cli("--preset", "demo", "--runs-dir", str(runs), *DEMO, "checkpoint.every=0",
                  fault="stop_at_step=3")
    assert stopped.returncode == 0 and "stopped at step 3" in stopped.stdout, stopped.stdout + stopped.stderr
    run = runs / "demo"
    assert not (run / "output").exists()  # a stopped run has no outputs of its own
    out = cli("--export", "demo", "--runs-dir", str(runs))  # by the run's name; the newest checkpoint
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outputs of step 3:" in out.stdout
    from diffusers import StableDiffusionPipeline

    base = yaml.safe_load((run / "config.yaml").read_text())["model"]["path"]  # the shipped demo model, resolved
    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.load_lora_weights(run / "output/step-000003")
    trained = load_file(str(run / "checkpoints/step-000003/trainable.safetensors"))
    assert_lora_loaded(pipe, trained)


@pytest.mark.parametrize("args, says", [
    (["--export", "no-such-run"], "--export no-such-run: no run folder there"),
    (["--step", "3"], "--step goes with --export RUN"),
    (["--export", "x", "--preset", "demo"], "not several"),
])
def test_bad_export_arguments_are_one_paragraph(tmp_path, args, says):
    out = cli(*args, "--runs-dir", str(tmp_path))
    assert out.returncode == 2
    assert says in out.stderr and "Traceback" not in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.slow  # `finished` trains a run
def test_a_step_without_a_checkpoint_is_refused_naming_the_ones_there(finished):
    out = cli("--export", str(finished), "--step", "3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no checkpoint of step 3; --step can be one of: 2, 4" in out.stderr


@pytest.mark.slow
def test_generate_waits_for_a_cpu_training_then_draws_the_base_beside_the_checkpoint(finished):
    """The Generate panel's path (app.generations -> python -m trainer.engine.generate): the demo on the CPU, the
    base alone and the base with step 2's LoRA, same seed: the LoRA changes the picture. Asked while a training
    holds the CPU, it waits for that run (saying so) and starts when it ends; while it draws, it holds the CPU
    (a run started then would queue behind it)."""
    import json

    import numpy as np
    from PIL import Image

    from app.generations import Request, result_of, run
    from trainer.core import queue
    from trainer.core.runlock import identity

    training = finished.parent / "training"  # a live CPU run: its launcher is a process this test ends
    training.mkdir()
    (training / "plan.json").write_text(json.dumps({"devices": "cpu"}))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    (training / "launcher.pid").write_text(identity(proc.pid))
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("queued"):
            proc.stdin.close()  # type: ignore[union-attr]  # the training ends
            proc.wait()
        if line.startswith("drawing the base alone"):
            said.append(f"held by {queue.busy_runs(finished.parent, frozenset({'cpu'}))}")

    try:
        out = run(finished.parent, finished, Request(step=2, prompt="a photo of a sks circle on a gray background",
                                                     seed=3, steps=4, guidance=5.0, scale=1.0), say=say, poll_s=0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(training)
    assert said[0] == "queued: waiting for training to end", said
    assert said[1:] == ["loading the model for step 2", "drawing the base alone (4 steps on cpu)",
                        "held by ['generation for run demo']", "drawing the base with step 2 at LoRA scale 1"]
    assert out.parent == finished / "generated"
    assert result_of(out) == {"step": 2, "prompt": "a photo of a sks circle on a gray background", "seed": 3,
                              "steps": 4, "guidance": 5.0, "scale": 1.0, "device": "cpu"}
    base, tuned = (np.asarray(Image.open(out / f"{n}.png"), dtype=float) for n in ("base", "tuned"))
    assert base.shape == tuned.shape == (64, 64, 3) and np.abs(base - tuned).mean() > 0.1
    with pytest.raises(UserError, match="Generating failed: .* has no checkpoint of step 3"):
        run(finished.parent, finished, Request(step=3, prompt="x", steps=2))
