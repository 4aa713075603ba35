"""train.log for people, on a real demo run through the command line: the plan, a progress line every N steps,
every sample, evaluation, checkpoint, stop, resume and the end, each once; the libraries' deprecation notices
in library.log instead."""

from __future__ import annotations

import pytest

import os
import re
import subprocess
import sys
from pathlib import Path

from trainer.core.runlog import LogLines, progress_every

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "IMAGETUNE_FAULT"}
    if fault:
        env["IMAGETUNE_FAULT"] = fault
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=ROOT)


@pytest.mark.slow
def test_a_demo_runs_log_tells_its_story(tmp_path):
    runs = tmp_path / "runs"
    common = ["--runs-dir", str(runs)]
    first = cli("--preset", "demo", *common, "train.steps=6", "sample.every=3", "sample.images_per_prompt=1",
                "sample.steps=2", "checkpoint.every=3", "batch.total=2", "batch.per_device=2",
                fault="stop_at_step=4")
    assert first.returncode == 0 and "stopped at step 4" in first.stdout, first.stdout + first.stderr
    run = runs / "demo"
    resumed = cli("--resume", str(run))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = (run / "train.log").read_text()
    stamp = r"\d\d:\d\d:\d\d "
    # the plan, and the run's story in order: each line once
    story = [r"plan: 1 process x 2 per device", r"step 1/6 · loss \d\.\d{4} · lr \S+",
             r"sample step 3 #0: 'a photo of a sks circle on a white background' -> samples/step-000003-p00\.png",
             r"eval step 3: concept", r"checkpoint step 3: checkpoints/step-000003", r"step 4/6 · loss",
             r"checkpoint step 4: checkpoints/step-000004",
             r"stopped at step 4 \(STOP file\); checkpoint checkpoints/step-000004",
             r"resumed at step 4 from checkpoints/step-000004", r"step 6/6 · loss .* it/s",
             r"checkpoint step 6", r"done at step 6; outputs: output/pytorch_lora_weights\.safetensors"]
    at = 0
    for pattern in story:
        found = re.compile(stamp + pattern, re.M).search(log, at)
        assert found, f"{pattern!r} not found after position {at} in:\n{log}"
        assert len(re.findall(stamp + pattern, log)) == 1, f"{pattern!r} more than once:\n{log}"
        at = found.end()
    assert "it/s" in log and "ETA" in log
    # third-party deprecation notices are kept apart, not lost
    assert "FutureWarning" not in log and "deprecat" not in log.lower(), log
    assert "There are modules in" not in log
    library = (run / "library.log").read_text()
    assert "There are modules in" in library  # diffusers' warning of the run's dtype cast, there rather than lost


def test_progress_lines_come_every_n_steps_at_round_numbers():
    assert [progress_every(s) for s in (6, 50, 51, 300, 1000, 10_000)] == [1, 1, 2, 10, 20, 200]
    lines = LogLines(steps=300, batch_total=4)
    shown = [s for s in range(1, 301) if lines.line({"type": "progress", "step": s, "steps": 300, "loss": 0.5,
                                                      "lr": 1e-4, "samples_per_s": 8.0, "eta_s": 61, "time": 0})]
    assert shown == [1, *range(10, 301, 10)]
    text = LogLines(steps=300, batch_total=4).line({"type": "progress", "step": 1, "steps": 300, "loss": 0.5,
                                                      "lr": 1e-4, "samples_per_s": 8.0, "eta_s": 61, "time": 0})
    assert text.endswith("step 1/300 · loss 0.5000 · lr 1.00e-04 · 2.00 it/s · ETA 1:01")
