"""The queue in Chromium. While a run holds the machine: runs queued from the command line show as `queued #N`
rows; Start in the UI queues the new run instead of training beside it; Cancel removes a run; a second UI on the
same runs folder (as this one restarted) shows the queue as it is. When the machine is free, the UI's queue runner
starts the next queued run, and it trains to the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.browser_helpers import REPO, AppProcess, choose, shot, wait_for, wait_text
from tests.test_browser import app, browser, page, sync_api  # noqa: F401  (the same app, browser and page)
from trainer.core.runfolder import RunFolder
from trainer.core.runlock import write_identity

pytestmark = pytest.mark.slow  # two UI servers, a browser and a short demo run

ROWS = "Array.from(document.querySelectorAll('#runs-table [role=row]')).map(r => r.innerText.replace(/\\s+/g, ' '))"
# sample.every=0 still draws at the start and the end (schema: "0: only at the start and the end"); the demo's
# 2 prompts x 4 images x 20 denoising steps cost ~4 s a draw on one core, so one image at 2 steps each.
QUICK = ["train.steps=2", "sample.every=0", "sample.steps=2", "sample.images_per_prompt=1", "checkpoint.every=0",
         "batch.total=2", "batch.per_device=2"]


def row(name: str, status: str) -> str:
    return f"{ROWS}.some(r => r.includes('{name} ') && r.includes('{status}'))"


def holding_run(runs_dir):
    """A run folder whose process (a sleeping child of this test) is alive: the machine is taken."""
    folder = RunFolder(runs_dir / "holder")
    folder.path.mkdir(parents=True)
    folder.config.write_text("name: holder\nmodel: {family: sd}\nmethod: lora\ntrain: {steps: 10}\n")
    folder.events.write_text(json.dumps({"type": "plan", "time": 1.0, "line": "holds the machine"}) + "\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    write_identity(folder.pid_file, sleeper.pid)
    return sleeper


def test_queue_in_the_ui_lists_queues_on_start_cancels_is_shared_and_runs(page, app, browser, tmp_path):  # noqa: F811
    sleeper = holding_run(app.runs_dir)
    try:
        for name in ("alpha", "beta"):
            out = subprocess.run([sys.executable, "launch.py", "--preset", "demo", "--runs-dir", str(app.runs_dir),
                                  f"name={name}", *QUICK, "--queue"], cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
        page.goto(app.url)
        # the page opens on the Runs tab while a run is alive; its first render took over 60 s on 2 cores busy with
        # the rest of the suite (the UI's start also runs its GPU probe, a child importing torch): as test_browser
        wait_text(page, "#run-header", "holder", timeout=150)
        page.click("#tab-train-button")
        page.click("#start-button")  # the demo preset, while `holder` runs: queued, not started beside it
        wait_text(page, "#start-message", "Queued", timeout=120)
        assert "as #3" in page.inner_text("#start-message")
        page.click("#tab-runs-button")
        wait_for(page, row("alpha", "queued #1"), what="alpha queued #1")
        wait_for(page, row("beta", "queued #2"), what="beta queued #2")
        wait_for(page, row("demo", "queued #3"), what="the UI's run queued #3")
        shot(page, "queue-listed", full_page=True)
        wait_for(page, "(document.querySelector('#queue-entry input')?.value || '').includes('#1 alpha')",
                 what="the queue control on alpha")
        # Reorder: Later moves alpha behind beta (the control stays on it), Earlier moves it back.
        page.click("#queue-down")
        wait_for(page, row("beta", "queued #1"), what="beta first after alpha moved down")
        wait_for(page, row("alpha", "queued #2"), what="alpha second")
        wait_for(page, "(document.querySelector('#queue-entry input')?.value || '').includes('#2 alpha')",
                 what="the queue control still on alpha")
        page.click("#queue-up")
        wait_for(page, row("alpha", "queued #1"), what="alpha first again")
        wait_for(page, "(document.querySelector('#queue-entry input')?.value || '').includes('#1 alpha')",
                 what="the queue control on alpha, first")
        page.click("#queue-cancel")
        wait_text(page, "#queue-message", "Cancelled #1 alpha")
        wait_for(page, row("beta", "queued #1"), what="beta moved up")
        choose(page, "queue-entry", "#2 demo")
        page.click("#queue-cancel")
        wait_text(page, "#queue-message", "Cancelled #2 demo")
        wait_for(page, f"!{ROWS}.some(r => r.includes('queued #2'))", what="only beta left")
        assert not page.evaluate(f"{ROWS}.some(r => r.includes('alpha'))")
        # A second UI on the same runs folder (as this one restarted would) reads the same queue from the folder.
        other = AppProcess(tmp_path, runs_dir=app.runs_dir)
        try:
            other.wait_ready()
            second = browser.new_page()
            second.goto(other.url)
            second.click("#tab-runs-button")
            wait_for(second, row("beta", "queued #1"), what="beta, in the second UI")
            assert not second.evaluate(f"{ROWS}.some(r => r.includes('alpha'))")
            second.close()
        finally:
            other.stop()
    finally:
        sleeper.kill()
        sleeper.wait()
    # The machine is free: the queue runner starts beta, which trains to the end
    wait_for(page, row("beta", "done"), timeout=300, what="beta started by the queue and done")
    assert json.loads((app.runs_dir / "beta" / "events.jsonl").read_text().splitlines()[-1])["type"] == "done"
