"""A stopped run's checkpoint in the Runs tab, in Chromium. Export: a run stopped before its end has a checkpoint and
no outputs; the user picks the checkpoint, presses Export, sees each file labelled with what loads it, and
downloads the LoRA, which holds the bytes the export wrote into the run folder. Generate: the user picks the
checkpoint, types a prompt and settings, sees the generation's progress, then the base alone beside the base with
the LoRA, which differ; the same seed again gives the same two images."""

from __future__ import annotations

import os
import subprocess
import sys

import urllib.request

import pytest

from tests.browser_helpers import REPO, Stages, set_value, shot, wait_for, wait_text
from tests.test_browser import app, browser, page, sync_api  # noqa: F401  (the same app, browser and page)

pytestmark = pytest.mark.slow  # a UI server, a real run and a browser


@pytest.fixture(scope="module")
def stopped(app):  # noqa: F811
    """The run both tests use, made headless (the path is tested in test_export_checkpoint.py): stopped at step 2
    of 6, with the checkpoint of step 2."""
    made = subprocess.run([sys.executable, "launch.py", "--preset", "demo", "--runs-dir", str(app.runs_dir),
                           "name=stopped-demo", "train.steps=6", "sample.every=0", "checkpoint.every=0",
                           # the step-0 samples (sample.every=0 still draws them) at one image, 2 denoising steps
                           "sample.steps=2", "sample.images_per_prompt=1", "batch.total=2", "batch.per_device=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "IMAGETUNE_FAULT": "stop_at_step=2"})
    assert made.returncode == 0 and "stopped at step 2" in made.stdout, made.stdout + made.stderr
    return app.runs_dir / "stopped-demo"


def test_a_stopped_runs_checkpoint_is_exported_labelled_and_downloaded(page, app, stopped):  # noqa: F811
    run = stopped
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


def _pixels(page, app, elem_id: str):  # noqa: F811
    """The pixels of the image a gr.Image shows, fetched as the browser does."""
    import numpy as np
    from PIL import Image

    src = page.evaluate(f"document.querySelector('#{elem_id} img')?.src || ''")
    assert src.startswith(app.url), src
    with urllib.request.urlopen(src, timeout=30) as r:
        return np.asarray(Image.open(r).convert("RGB"), dtype=float)


def test_generate_shows_progress_then_the_base_beside_the_lora_the_same_again_for_the_same_seed(  # noqa: F811
        page, app, stopped):
    mark = Stages()  # seconds per stage, printed (a generation is two model loads on a shared CPU)
    page.goto(app.url)
    page.click("#tab-runs-button")
    wait_text(page, "#run-status", "stopped", timeout=60)
    mark("run shown")
    page.click("#generate-accordion .label-wrap")
    wait_for(page, "(document.querySelector('#generate-step input')?.value || '').includes('step 2')",
             what="the Generate panel on step 2")
    for elem_id, value in (("generate-prompt", "a photo of a sks circle on a gray background"),
                           ("generate-seed", 3), ("generate-steps", 4), ("generate-guidance", 5),
                           ("generate-scale", 1)):
        set_value(page, elem_id, value)
    mark("form filled")
    # Every text the message shows, kept as it changes (progress lines may pass quicker than a poll).
    page.evaluate("""() => { const seen = window.generateSeen = [], box = document.querySelector('#generate-message');
        new MutationObserver(() => { const t = box.innerText; if (t && seen[seen.length - 1] !== t) seen.push(t); })
            .observe(box, {subtree: true, childList: true, characterData: true}); }""")
    shown = []
    for attempt in range(2):  # done: this click's first message seen, and since then the images and an ok
        page.click("#generate-button")
        mark("clicked")
        wait_for(page, f"document.querySelectorAll('#generate-message .msg-box.ok').length && "
                       f"document.querySelector('#generate-tuned img')?.src && "
                       f"window.generateSeen.filter(t => t.startsWith('Generating step 2')).length > {attempt}",
                 timeout=240, what=f"generation {attempt + 1}'s images (the message showed "
                                   f"{page.evaluate('window.generateSeen')})")
        assert "Step 2 at LoRA scale 1, seed 3, 4 steps, guidance 5 on cpu" in page.inner_text("#generate-message")
        mark("images shown")
        shown.append({name: _pixels(page, app, f"generate-{name}") for name in ("base", "tuned")})
    seen = " | ".join(page.evaluate("window.generateSeen"))
    assert "loading the model for step 2" in seen and "drawing the base with step 2 at LoRA scale 1" in seen, seen
    shot(page, "generate-done", full_page=True)
    first, second = shown
    assert first["base"].shape == (64, 64, 3) and abs(first["base"] - first["tuned"]).mean() > 0.1  # the LoRA shows
    for name in ("base", "tuned"):  # the same seed, the same pictures
        assert (first[name] == second[name]).all(), name
    assert len(list((stopped / "generated").glob("*/result.json"))) == 2  # drawn twice, not shown from a cache
