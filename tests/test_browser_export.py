"""The Runs tab's export, in Chromium: a run stopped before its end has a checkpoint and no outputs; the user picks
the checkpoint, presses Export, sees each file labelled with what loads it, and downloads the LoRA, which holds
the bytes the export wrote into the run folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.browser_helpers import REPO, shot, wait_for, wait_text
from tests.test_browser import app, browser, page, sync_api  # noqa: F401  (the same app, browser and page)

pytestmark = pytest.mark.slow  # a UI server, a real run and a browser


def test_a_stopped_runs_checkpoint_is_exported_labelled_and_downloaded(page, app):  # noqa: F811
    # The run is made headless (the path is tested in test_export_checkpoint.py): stopped at step 2 of 6.
    made = subprocess.run([sys.executable, "launch.py", "--preset", "demo", "--runs-dir", str(app.runs_dir),
                           "name=stopped-demo", "train.steps=6", "sample.every=0", "checkpoint.every=0",
                           # the step-0 samples (sample.every=0 still draws them) at one image, 2 denoising steps
                           "sample.steps=2", "sample.images_per_prompt=1", "batch.total=2", "batch.per_device=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "IMAGETUNE_FAULT": "stop_at_step=2"})
    assert made.returncode == 0 and "stopped at step 2" in made.stdout, made.stdout + made.stderr
    run = app.runs_dir / "stopped-demo"
    page.goto(app.url)
    page.click("#tab-runs-button")
    wait_text(page, "#run-status", "stopped", timeout=60)
    wait_for(page, "document.querySelector('#export-button')?.innerText.includes('Export step 2')",
             what="the Export button for step 2")
    assert not page.query_selector("#export-files a")  # nothing exported yet
    page.click("#export-button")
    wait_text(page, "#export-message", "Exporting step 2")
    wait_text(page, "#export-files", "pytorch_lora_weights", timeout=180)  # the name wraps at its dot
    labels = wait_text(page, "#output-labels", "output/step-000002/pytorch_lora_weights.safetensors")
    assert "diffusers: pipe.load_lora_weights" in labels and "ComfyUI / A1111 / Forge" in labels
    wait_for(page, "(document.querySelector('#export-step input')?.value || '').includes('step 2 · exported')",
             what="the checkpoint marked exported")
    shot(page, "export-done", full_page=True)
    link = page.locator("#export-files tr", has_text="pytorch_lora_weights").locator("a[download]").first
    with page.expect_download() as download:
        link.click()
    saved = download.value.path()
    assert saved.read_bytes() == (run / "output/step-000002/pytorch_lora_weights.safetensors").read_bytes()
