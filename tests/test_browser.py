"""The web UI in a real browser: Debian's Chromium driven by Playwright (nothing is downloaded).

One newcomer's session, end to end, against `python launch.py` on a free port with a temporary runs folder:
choose a preset, see the plan change with devices and batch, see a bad value flagged at its field, set up a
short CPU run through the YAML editor, start it, watch progress, loss and samples arrive, stop it, resume it,
reload the page and find the run still followed; kill it, delete it (after confirming).
Screenshots of each stage go to test-artifacts/screenshots/ (and the stage timings to test-artifacts/).
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from tests.browser_helpers import (
    CHROMIUM_ARGS,
    AppProcess,
    Stages,
    choose,
    chromium_path,
    input_of,
    set_value,
    shot,
    step_shown,
    stop_runs,
    wait_code_text,
    wait_for,
    wait_text,
    write_detection_run,
)

from app.main import UI_NICE
from trainer.core.runfolder import RunFolder

pytestmark = pytest.mark.slow  # a UI server, real runs and a browser

# A CPU-only demo run at 32 pixels, typed into the YAML editor in one line (flow style, so no indentation to type).
# Its step count is only an upper bound: the scenario stops it, resumes it and finally kills it within a minute or
# two, and it must still be training when it is killed (a fast machine does 15 steps a second).
SHORT_RUN = (
    '{name: browser-test, devices: "cpu:1", model: {path: "demo://tiny-sd"}, '
    'data: {path: "demo://demo-data", resolution: 32, flip: true}, lora: {rank: 4, alpha: 4}, '
    'batch: {total: 1, per_device: 1}, train: {steps: 5000, lr: 0.001, scheduler: constant}, '
    'sample: {every: 25, prompts: [a red circle, a blue square], steps: 2, size: 32}, checkpoint: {every: 0}}'
)


@pytest.fixture(scope="module", autouse=True)
def sync_api():
    """Playwright and Debian's Chromium are part of the test install (.ci/run). Without them the tests skip and
    say why, before the app starts; IMAGETUNE_REQUIRE_BROWSER=1 (set by .ci/run) makes that a failure, so CI
    cannot pass without having driven a browser."""
    missing = _missing_browser()
    if missing and os.environ.get("IMAGETUNE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"IMAGETUNE_REQUIRE_BROWSER=1, but {missing}", pytrace=False)
    if missing:
        pytest.skip(missing)
    from playwright import sync_api

    return sync_api


def _missing_browser() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package `playwright` is not installed: pip install -e '.[test]' (or run .ci/run)"
    if chromium_path() is None:
        return ("Debian's Chromium is not installed (no `chromium` on PATH): sudo apt-get install -y chromium "
                "(or run .ci/run); Playwright's own browser download is not used")
    return None


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    started = time.monotonic()
    server = AppProcess(tmp)
    try:
        server.wait_ready()
        print(f"app answered after {time.monotonic() - started:.1f}s", flush=True)
        yield server
    finally:
        ending = time.monotonic()
        stop_runs(server.runs_dir)
        server.stop()
        print(f"app and runs stopped in {time.monotonic() - ending:.1f}s", flush=True)


@pytest.fixture(scope="module")
def browser(sync_api):
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, app):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    context.close()


def plan_text(page) -> str:
    return page.inner_text("#plan-text")


def test_newcomer_runs_the_demo_end_to_end(page, app):
    stage = Stages()
    try:
        scenario(page, app, stage)
    except BaseException:
        shot(page, "99-at-failure", full_page=True)  # what the page showed when it went wrong
        print(f"app log (last lines):\n{app.log()}", flush=True)
        for run in sorted(app.runs_dir.glob("*/events.jsonl")):  # how far each run got, and what it printed last
            events = run.read_text().splitlines()
            log = run.with_name("train.log")
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            print(f"{run.parent.name}: last events:\n" + "\n".join(events[-5:]) + "\ntrain.log:\n" + "\n".join(tail))
        raise
    finally:
        stage.save()


def scenario(page, app, stage):
    page.goto(app.url)
    page.wait_for_selector("#start-button")
    wait_text(page, "#plan-text", "process", timeout=150)  # after the GPU probe (a child process)
    assert "demo" in page.input_value("#preset input")  # the demo is selected for a newcomer
    shot(page, "01-new-run-form")
    stage("page ready, plan shown")

    # A preset whose data folder does not exist here: the error sits at data.path; back to the demo, it goes away.
    choose(page, "preset", "sd15-lora")
    wait_text(page, "#err-data-path", "does not exist")
    choose(page, "preset", "demo")
    page.wait_for_selector("#err-data-path", state="hidden")
    assert input_of(page, "field-model-path").input_value() == "demo://tiny-sd"

    # The plan follows devices and batch.
    choose(page, "field-devices", "cpu:2")
    wait_text(page, "#plan-text", "2 processes x 2 per device x accumulation 1 = batch 4")
    set_value(page, "field-batch-total", 8)
    wait_text(page, "#plan-text", "2 processes x 2 per device x accumulation 2 = batch 8")
    shot(page, "02-plan-follows-devices-and-batch")
    stage("plan followed devices and batch")

    # A bad value is flagged at its field, listed by the Start button, written into the YAML; Start refuses.
    set_value(page, "field-train-lr", "-1")
    wait_text(page, "#err-train-lr", "must be greater than zero")
    wait_text(page, "#problems", "train.lr")
    page.click("#yaml-accordion .label-wrap")
    wait_code_text(page, "yaml-editor", "lr: -1.0")
    page.click("#start-button")
    wait_text(page, "#start-message", "Not started")
    page.locator("#field-train-lr").scroll_into_view_if_needed()
    shot(page, "03-error-at-the-field")
    stage("error shown at train.lr")

    # A YAML syntax error is the problem listed next to Start (not a key of what was typed before it).
    page.click("#yaml-editor .cm-content")
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.insert_text("tversion: 1\ntrain: {steps: 40\n")
    wait_text(page, "#problems", "YAML: ")
    assert "train.lr" not in page.inner_text("#problems") and "tversion" not in page.inner_text("#problems")

    # The YAML editor drives the form: a short CPU run.
    page.click("#yaml-editor .cm-content")
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.insert_text(SHORT_RUN)
    wait_text(page, "#plan-text", "1 process x 1 per device x accumulation 1 = batch 1")
    page.wait_for_selector("#err-train-lr", state="hidden")
    assert input_of(page, "field-train-steps").input_value() == "5000"
    assert input_of(page, "field-name").input_value() == "browser-test"
    assert input_of(page, "field-devices").input_value() == "cpu:1"

    # Save these settings as a preset of one's own.
    page.click("#save-accordion .label-wrap")
    set_value(page, "save-name", "short-cpu-demo")
    page.click("#save-button")
    wait_text(page, "#save-accordion", "Saved as")
    assert "steps: 5000" in (app.home / "presets" / "short-cpu-demo.yaml").read_text()
    assert "short-cpu-demo" in page.input_value("#preset input")

    # Check the training images: the dataset page opens with data.path filled in.
    page.click("#check-data-button")
    wait_text(page, "#dataset-summary", "16 images", timeout=60)
    wait_for(page, "document.querySelectorAll('#dataset-gallery img').length >= 16", timeout=30)
    wait_for(page, "[...document.querySelectorAll('#dataset-gallery img')].slice(0, 12)"
                   ".every(i => i.complete && i.naturalWidth > 0)", timeout=30, what="the thumbnails on screen loaded")
    wait_text(page, "#dataset-problems", "No problems found")
    shot(page, "04-dataset-check")
    stage("preset saved, dataset checked")
    page.click("#tab-train-button")

    page.click("#start-button")
    wait_text(page, "#run-header", "browser-test", timeout=120)  # the Runs tab, following the new run
    wait_text(page, "#run-status", "running")
    stage("run started")
    # The page-serving UI runs below the run it started (app.main.lower_priority), the run at the UI's own start
    # priority, this test's (Linux: a priority is per thread, and the run starts from a thread made before).
    if sys.platform.startswith("linux"):
        launcher = RunFolder(app.runs_dir / "browser-test").launcher_pid()
        assert launcher is not None
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, launcher) == ours
        assert os.getpriority(os.PRIO_PROCESS, app.proc.pid) == min(ours + UI_NICE, 19)

    # Progress, a loss point and samples arrive while it trains.
    wait_for(page, "document.querySelectorAll('#samples-all td img').length >= 1", timeout=240)
    wait_for(page, "Number(document.querySelector('#run-progress .step')?.dataset.step) >= 2", timeout=120)
    assert re.search(r"loss \d\.\d{4}", page.inner_text("#run-progress"))
    assert re.search(r"\d\.\d\d it/s", page.inner_text("#run-progress"))
    wait_for(page, "[...document.querySelectorAll('#loss-plot svg.marks g.mark-line path')]"
                   ".some(p => (p.getAttribute('d') || '').length > 0)", timeout=30)  # the loss line is drawn
    wait_text(page, "#runs-table", "browser-test")
    shot(page, "05-training-live", full_page=True)
    stage("samples, loss and progress shown")

    # Stop: a checkpoint, then `stopped`.
    page.click("#stop-button")
    wait_text(page, "#run-status", "stopped", timeout=120)
    stopped_at = step_shown(page)
    assert stopped_at >= 2
    shot(page, "06-stopped")
    stage("stopped")

    # Resume, reload the page: the run is found again and followed live.
    page.click("#resume-button")
    wait_text(page, "#run-message", "Resumed")
    wait_text(page, "#run-status", "running")
    # This launch's part of train.log: its command line (a one-process run is its worker, without torchrun's
    # [rank0] prefixes). Looked for at once: the log shows its last 30 lines, and at ~15 steps/s on an idle
    # machine progress and sample lines push the command line out of them within seconds.
    page.click("#log-accordion .label-wrap")
    wait_for(page, "(document.querySelector('#run-log textarea')?.value || '').includes('--resume')", timeout=30)
    page.reload()
    stage("resumed, page reloading")
    wait_text(page, "#run-header", "browser-test", timeout=60)  # a page opened while a run trains shows it
    wait_text(page, "#run-status", "running")
    wait_for(page, f"Number(document.querySelector('#run-progress .step')?.dataset.step) > {stopped_at}",
             timeout=240)
    # The loss plot is drawn on the page's first load too (it was a blank box when the tab was switched to).
    wait_for(page, "(() => { const c = document.querySelector('#loss-plot canvas, #loss-plot svg');"
                   " const r = c?.getBoundingClientRect(); return r && r.width > 100 && r.height > 100; })()",
             timeout=30)
    # Samples as a grid, prompts down and steps across; a click enlarges one.
    wait_for(page, "document.querySelectorAll('#samples-all .grid-step').length >= 2", timeout=120)
    # (the newest step's: the grid keeps the newest 24 steps, so an older column may leave it as the run goes on)
    page.click("#samples-all tbody tr:first-child td:last-child a")
    wait_for(page, "(() => { const zoom = document.querySelector('#samples-all .grid-zoom:target');"
                   " return !!zoom && getComputedStyle(zoom).position === 'fixed'; })()", what="the enlarged sample")
    page.click("#samples-all .grid-zoom:target")
    wait_for(page, "!document.querySelector('#samples-all .grid-zoom:target')")
    shot(page, "07-resumed-and-followed-after-reload", full_page=True)
    stage("progress after reload")

    # Kill: SIGTERM to the process group (the workers still save a checkpoint when they can), SIGKILL later.
    # Asked first, naming what a kill loses; afterwards the page says truly how it ended.
    page.click("#kill-button")
    wait_text(page, "#confirm-kill-row", "Kill run browser-test now?")
    page.click("#confirm-kill")
    wait_text(page, "#run-message", "Killing browser-test")
    wait_for(page, "['stopped', 'failed'].includes(document.querySelector('#run-status')?.textContent.trim())",
             timeout=90)
    if page.inner_text("#run-status").strip() == "failed":
        wait_text(page, "#run-failed", "Killed")
        assert "restarted" not in page.inner_text("#run-failed")
    stage("killed")

    # Delete, with a confirmation first.
    page.click("#delete-button")
    wait_text(page, "#confirm-row", "cannot be undone")
    page.click("#confirm-delete")
    wait_text(page, "#run-message", "Deleted browser-test")
    wait_text(page, "#runs-table", "browser-test", absent=True)
    assert not (app.runs_dir / "browser-test").exists()
    stage("deleted")


def test_a_detection_run_shows_map_per_class_ap_the_best_step_and_its_samples(page, app):
    """A finished detection run (synthetic run folder: no training needed) on the Runs tab."""
    write_detection_run(app.runs_dir, "detector")
    page.goto(app.url)
    page.click("#tab-runs-button")
    choose(page, "run-select", "detector")
    wait_text(page, "#run-header", "detection")
    wait_text(page, "#run-status", "done")
    box = wait_text(page, "#run-eval", "Best so far: step 5 (mAP 0.420)")
    assert "Latest evaluation: step 10 on 8 validation images" in box
    assert re.search(r"circle\s+0\.500\s+0\.750", box) and "<tri>" in box
    wait_for(page, "[...document.querySelectorAll('#eval-plot svg.marks g.mark-line path')]"
                   ".filter(p => (p.getAttribute('d') || '').length > 0).length >= 2", timeout=30,
             what="the mAP and mAP50 lines")
    wait_for(page, "document.querySelectorAll('#samples-all td img').length >= 3", timeout=30)
    captions = page.inner_text("#samples-all")
    assert "val image 0" in captions and "precision-recall" in captions
    page.locator("#run-eval").scroll_into_view_if_needed()
    shot(page, "08-detection-run", full_page=True)


def test_captions_are_edited_inline_and_replaced_across_the_folder_after_a_preview(page, app, tmp_path):
    from PIL import Image

    folder = tmp_path / "captioned"
    folder.mkdir()
    for name, caption in (("a.png", "a cat on grass"), ("b.png", "a dog on grass"), ("c.png", "a bird")):
        Image.new("RGB", (16, 16), (40, 160, 40)).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
    page.goto(app.url)
    page.get_by_role("tab", name="Dataset check").click()
    set_value(page, "dataset-path", str(folder))
    page.click("#captions-load")
    wait_text(page, "#captions-message", "3 images")
    wait_for(page, "document.querySelectorAll('.caption-row img').length == 3", what="a thumbnail per caption")
    assert input_of(page, "caption-edit-2").input_value() == "a bird"

    set_value(page, "caption-edit-2", "a small bird on grass")  # saved when the box loses focus
    wait_text(page, "#captions-message", "Saved c.png")
    assert (folder / "c.txt").read_text(encoding="utf-8") == "a small bird on grass\n"

    set_value(page, "captions-find", "grass")
    set_value(page, "captions-replace", "snow")
    page.click("#captions-preview")
    wait_text(page, "#captions-changes", "3 captions will change")
    assert (folder / "a.txt").read_text(encoding="utf-8") == "a cat on grass\n"  # nothing written before Apply
    page.click("#captions-apply")
    wait_text(page, "#captions-changes", "Changed 3 captions")
    assert [(folder / f"{n}.txt").read_text(encoding="utf-8") for n in "abc"] == [
        "a cat on snow\n", "a dog on snow\n", "a small bird on snow\n"]
    wait_for(page, "document.querySelector('#caption-edit-0 textarea')?.value == 'a cat on snow'",
             what="the editor shows the new captions")
