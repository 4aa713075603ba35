"""logging.tensorboard / logging.wandb: a run's events mirrored to TensorBoard and W&B (trainer.engine.mirrors),
through the real command line, and across a stop and a `--resume`. W&B runs offline (WANDB_MODE=offline): nothing
leaves this machine; its offline run folders are read back instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.core.config import load_config
from trainer.core.config.load import ConfigError
from trainer.core.events import read_events
from trainer.engine.mirrors import TENSORBOARD_DIR, WANDB_ID_FILE

REPO = Path(__file__).resolve().parents[1]
# Two processes: only rank 0 may log (a second writer would double every point and open a second W&B run).
OVERRIDES = ["devices=cpu:2", "precision=fp32", "train.steps=4", "train.warmup_steps=0", "sample.every=2",
             "sample.steps=2", "sample.images_per_prompt=1", "checkpoint.every=0", "lora.train_text_encoder=false"]


def _launch(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           **extra}
    env.pop("WANDB_API_KEY", None)
    return env


def _scalars(logdir: Path) -> tuple[dict[str, list[int]], list[str], list[str]]:
    """{tag: steps} of the scalars, the image tags and the text tags TensorBoard reads from the folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return ({tag: [s.step for s in acc.Scalars(tag)] for tag in tags["scalars"]}, tags["images"],
            tags["tensors"])


@pytest.mark.slow
def test_a_stopped_and_resumed_run_logs_one_tensorboard_run_and_one_wandb_run(tmp_path):
    env = _env(tmp_path, IMAGETUNE_FAULT="stop_at_step=2")
    runs = tmp_path / "runs"
    started = _launch("--preset", "demo", "--runs-dir", str(runs), *OVERRIDES, "logging.tensorboard=true",
                      "logging.wandb=imagetune-test", env=env)
    assert started.returncode == 0, started.stderr[-3000:]
    run_dir = runs / "demo"
    assert "stopped at step 2" in started.stdout
    wandb_id = (run_dir / WANDB_ID_FILE).read_text()
    resumed = _launch("--resume", str(run_dir), env=_env(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    scalars, images, texts = _scalars(run_dir / TENSORBOARD_DIR)
    assert len(list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2  # one writer per launch
    # One curve over both launches: steps 1-4 once each (the resume hides only what was logged past step 2, the
    # checkpoint it continues from: nothing here, since the stop checkpointed the step where logging stopped).
    assert scalars["train/loss"] == [1, 2, 3, 4] and scalars["train/lr"] == [1, 2, 3, 4]
    # Every eval metric, as events.jsonl has it (the resume draws its starting step's samples again: 0, 2, 2, 4).
    evals = [e["step"] for e in read_events(run_dir) if e["type"] == "eval"]
    assert evals[0] == 0 and evals[-1] == 4
    assert scalars["eval/concept"] == evals and scalars["eval/control"] == evals
    assert sorted(images) == ["samples/00", "samples/01"]
    assert {"plan/text_summary", "config/text_summary"} <= set(texts)

    # W&B: the resume continued the run of the first launch (same id, `resume="allow"`), in the run folder.
    assert (run_dir / WANDB_ID_FILE).read_text() == wandb_id
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{wandb_id}") for name in offline), offline
    for folder in (run_dir / "wandb").glob("offline-run-*"):
        assert (folder / f"run-{wandb_id}.wandb").stat().st_size > 0
    media = list((run_dir / "wandb").glob("offline-run-*/files/media/images/samples/*.png"))
    assert len(media) == 2 * len(evals), media  # each prompt's image at every sample step


def test_a_missing_package_names_its_extra_and_the_command_line_exits_2(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["logging.tensorboard=true", "logging.wandb=my-team/my-project"], check_paths=False)
    text = str(caught.value)
    assert "pip install 'imagetune[tensorboard]'" in text and "pip install 'imagetune[wandb]'" in text

    # Through the command line: a sitecustomize makes the packages look uninstalled in the launched process.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "_real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name in ('tensorboard', 'wandb') else _real(name, *a)\n")
    result = _launch("--preset", "demo", "--dry-run", "logging.tensorboard=true",
                     env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert "logging.tensorboard" in result.stderr and "imagetune[tensorboard]" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_wandb_project_wandb_would_refuse_is_named():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["logging.wandb=my project?"], check_paths=False)
    assert "logging.wandb" in str(caught.value) and "entity/project" in str(caught.value)
    assert load_config(None, ["logging.wandb=team/proj-1"], check_paths=False).logging.wandb == "team/proj-1"
