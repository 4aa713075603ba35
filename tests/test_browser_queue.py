"""The queue on the Runs tab, in Chromium: runs queued from the command line show as `queued #N` rows; Cancel in
one UI removes a run, and a second UI on the same runs folder (as after a restart) shows the queue as it is now."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.browser_helpers import REPO, AppProcess, shot, wait_for, wait_text
from tests.test_browser import app, browser, page, sync_api  # noqa: F401  (the same app, browser and page)

pytestmark = pytest.mark.slow  # two UI servers and a browser (nothing trains: no queue worker runs)

ROWS = "Array.from(document.querySelectorAll('#runs-table [role=row]')).map(r => r.innerText.replace(/\\s+/g, ' '))"


def test_queued_runs_are_listed_cancelled_and_seen_by_a_second_ui(page, app, browser, tmp_path):  # noqa: F811
    for name in ("alpha", "beta"):
        out = subprocess.run([sys.executable, "launch.py", "--preset", "demo", "--runs-dir", str(app.runs_dir),
                              f"name={name}", "--queue"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    page.goto(app.url)
    page.click("#tab-runs-button")
    wait_for(page, f"{ROWS}.some(r => r.includes('alpha') && r.includes('queued #1'))", what="alpha queued #1")
    wait_for(page, f"{ROWS}.some(r => r.includes('beta') && r.includes('queued #2'))", what="beta queued #2")
    wait_for(page, "(document.querySelector('#queue-entry input')?.value || '').includes('#1 alpha')",
             what="the queue control on alpha")
    shot(page, "queue-listed", full_page=True)
    page.click("#queue-cancel")
    wait_text(page, "#queue-message", "Cancelled #1 alpha")
    wait_for(page, f"{ROWS}.some(r => r.includes('beta') && r.includes('queued #1'))", what="beta moved up")
    assert not page.evaluate(f"{ROWS}.some(r => r.includes('alpha'))")
    # A second UI on the same runs folder (as this one restarted would) reads the same queue from the folder.
    other = AppProcess(tmp_path, runs_dir=app.runs_dir)
    try:
        other.wait_ready()
        second = browser.new_page()
        second.goto(other.url)
        second.click("#tab-runs-button")
        wait_for(second, f"{ROWS}.some(r => r.includes('beta') && r.includes('queued #1'))", what="beta, in UI 2")
        assert not second.evaluate(f"{ROWS}.some(r => r.includes('alpha'))")
        second.close()
    finally:
        other.stop()
