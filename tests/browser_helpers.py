"""Helpers for the browser tests: the app in a subprocess on a free port, Debian's Chromium through Playwright,
and small waits on Gradio's DOM (every wait polls a condition with a timeout; no fixed sleeps)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic", "--no-first-run"]


def chromium_path() -> str | None:
    debian = "/usr/bin/chromium"  # where Debian installs it, in case PATH is trimmed
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found or (debian if os.access(debian, os.X_OK) else None)


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppProcess:
    """`python launch.py --port P --runs-dir D` with its output in a log file."""

    def __init__(self, tmp: Path, port: int | None = None, extra_env: dict | None = None, runs_dir: Path | None = None):
        self.port = port or free_port()
        self.runs_dir = runs_dir or tmp / "runs"  # another app's: two UIs on one runs folder
        self.home = tmp / "home"
        self.log_path = tmp / "app.log"
        env = {**os.environ, "IMAGETUNE_HOME": str(self.home), "GRADIO_ANALYTICS_ENABLED": "False",
               "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        env.pop("IMAGETUNE_AUTH", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "launch.py", "--port", str(self.port), "--runs-dir", str(self.runs_dir)],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the app exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the app did not answer on {self.url} within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def stop_runs(runs_dir: Path, timeout: float = 60) -> None:
    """Leave no training processes behind: ask every unfinished run to stop, kill what does not."""
    from trainer.core.events import final_event, read_events
    from trainer.core.launcher import kill_run
    from trainer.core.runfolder import RunFolder, request_stop

    if not runs_dir.is_dir():
        return
    # Only runs whose launcher still runs can end: a test's stand-in run (a folder and a sleeper's pid, ended by
    # the test) never writes a final event, and waiting for one cost the whole timeout.
    def alive(run: Path) -> bool:
        return final_event(read_events(run)) is None and RunFolder(run).launcher_pid() is not None

    runs = [p for p in runs_dir.iterdir() if (p / "events.jsonl").exists()]
    for run in runs:
        if alive(run):
            request_stop(run)
    deadline = time.monotonic() + timeout
    for run in runs:
        while alive(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        kill_run(run, grace_s=5)


# ----------------------------------------------------------------------------------------------------------------
# Gradio DOM


def input_of(page, elem_id: str):
    """The text/number input (or textarea) of the Gradio component with this elem_id."""
    return page.locator(f"#{elem_id} input:not([type=checkbox]), #{elem_id} textarea").first


def set_value(page, elem_id: str, value) -> None:
    """Type into a Textbox/Number like a user (Gradio's `.input` fires), then leave the field."""
    box = input_of(page, elem_id)
    box.fill(str(value))
    box.blur()


def choose(page, elem_id: str, option: str) -> None:
    """Pick `option` (its visible text, or the start of it) in a Gradio Dropdown."""
    page.locator(f"#{elem_id} input").click()
    page.locator("[role=option]", has_text=option).first.click()


def wait_text(page, selector: str, text: str, timeout: float = 30, absent: bool = False) -> str:
    """Wait until the element's text contains `text` (or, with absent, no longer does); return the text."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        el = page.query_selector(selector)
        last = el.inner_text() if el else ""
        if (text in last) != absent:
            return last
        page.wait_for_timeout(250)
    raise AssertionError(f"{selector}: waited {timeout}s for {'no ' if absent else ''}{text!r}; it shows {last!r}")


def wait_for(page, js: str, timeout: float = 30, what: str = "") -> object:
    """Wait until the JS expression is truthy; return its value."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        handle = page.wait_for_function(js, timeout=timeout * 1000)
    except PlaywrightTimeout:
        status = page.evaluate("document.querySelector('#run-status')?.textContent || ''")
        progress = page.evaluate("document.querySelector('#run-progress')?.innerText || ''")
        raise AssertionError(f"waited {timeout}s for {what or js}; run status {status!r}, progress {progress!r}") \
            from None
    return handle.json_value()


def step_shown(page) -> int:
    value = page.evaluate("(() => { const e = document.querySelector('#run-progress .step'); "
                          "return e ? Number(e.dataset.step) : -1 })()")
    return int(value)


def shot(page, name: str, full_page: bool = False) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def code_text(page, elem_id: str) -> str:
    """The whole text of a gr.Code editor (CodeMirror only puts the visible lines in the DOM)."""
    return page.evaluate(
        """(id) => { const c = document.querySelector(`#${id} .cm-content`); if (!c) return '';
           const view = (c.cmTile && c.cmTile.view) || (c.cmView && c.cmView.view);
           return view ? view.state.doc.toString() : c.innerText; }""", elem_id)


def wait_code_text(page, elem_id: str, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = code_text(page, elem_id)
        if text in last:
            return last
        page.wait_for_timeout(250)
    raise AssertionError(f"#{elem_id}: waited {timeout}s for {text!r} in the editor; it holds {last[:400]!r}")


class Stages:
    """Seconds since the scenario began, per stage (printed, and kept next to the screenshots)."""

    def __init__(self):
        self.start = time.monotonic()
        self.marks: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        self.marks.append((name, time.monotonic() - self.start))
        print(f"[{self.marks[-1][1]:6.1f}s] {name}", flush=True)

    def save(self) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        (SCREENSHOTS.parent / "browser-timings.txt").write_text(
            "".join(f"{t:7.1f}s  {name}\n" for name, t in self.marks))


# ----------------------------------------------------------------------------------------------------------------
# A synthetic detection run (no torch): what trainer/engine/run_io.py and trainer/families/detection*.py write


def detection_events(t0: float) -> list[dict]:
    """A detection fine-tune evaluated at steps 5 and 10 (step 5 is the best), then done. Samples: two fixed
    validation images (indices 0, 1) and, at each evaluation, the precision-recall curve (index 2)."""
    def progress(step, loss):
        return {"type": "progress", "step": step, "steps": 10, "loss": loss, "lr": 1e-3, "samples_per_s": 4.0,
                "eta_s": 10 - step}

    def samples(step, map50):
        return [{"type": "sample", "step": step, "index": i, "prompt": prompt,
                 "path": f"samples/step-{step:06d}-p{i:02d}.png"}
                for i, prompt in enumerate(["val image 0: img_000.jpg: 3 predicted (score >= 0.3), 2 true",
                                            "val image 1: img_001.jpg: 0 predicted (score >= 0.3), 1 true",
                                            f"precision-recall curve (IoU 0.5), mAP50 {map50}"])]

    def evaluation(step, map_, map50, per_class):
        return {"type": "eval", "step": step, "map": map_, "map50": map50, "map75": round(map_ * 0.9, 5),
                "mar100": round(map50 * 0.8, 5), "images": 8,
                "per_class": {name: {"map": ap, "map50": ap50} for name, (ap, ap50) in per_class.items()}}

    events = [
        {"type": "plan", "line": "1 process x 2 per device x accumulation 1 = batch 2 · fp32 · cpu", "total": 2,
         "steps": 10, "world_size": 1, "per_device": 2, "accumulation": 1, "precision": "fp32", "notes": []},
        progress(1, 2.5), progress(5, 1.8), *samples(5, 0.61),
        evaluation(5, 0.42, 0.61, {"circle": (0.55, 0.8), "square": (0.29, 0.42), "<tri>": (None, None)}),
        {"type": "best", "step": 5, "metric": "map", "value": 0.42, "path": "checkpoints/best", "previous": None},
        progress(10, 1.5), *samples(10, 0.58),
        evaluation(10, 0.4, 0.58, {"circle": (0.5, 0.75), "square": (0.3, 0.41), "<tri>": (None, None)}),
        {"type": "done", "step": 10, "outputs": ["output/model.safetensors", "output/best.safetensors"]},
    ]
    return [{"time": t0 + i, **e} for i, e in enumerate(events)]


def _detection_picture(index: int, step: int):
    """A sample picture like the family's: truth (left) and predictions (right), or a precision-recall curve."""
    from PIL import Image, ImageDraw

    if index == 2:
        img = Image.new("RGB", (280, 200), "white")
        draw = ImageDraw.Draw(img)
        draw.rectangle([30, 20, 270, 180], outline="black")
        draw.line([(30 + x * 24, 20 + int(160 * (x / 10) ** 2)) for x in range(11)], fill=(30, 90, 200), width=2)
        draw.text((34, 4), f"precision-recall, step {step}", fill="black")
        return img
    img = Image.new("RGB", (256, 128), (235, 235, 235))
    draw = ImageDraw.Draw(img)
    for half, colour in ((0, (0, 160, 0)), (128, (220, 40, 40))):
        draw.ellipse([half + 20, 30, half + 70, 80], fill=(240, 120, 120))
        draw.rectangle([half + 16, 26, half + 74, 84], outline=colour, width=2)
        draw.text((half + 16, 12), "truth" if half == 0 else f"pred {0.9 - index / 10:.2f}", fill=colour)
    return img


def write_detection_run(runs_dir: Path, name: str = "detector", t0: float | None = None) -> Path:
    import json

    run = Path(runs_dir) / name
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text(json.dumps({
        "name": name, "model": {"family": "detection", "path": "fasterrcnn_mobilenet_v3_large_320_fpn"},
        "method": "full", "train": {"steps": 10}}))  # JSON is YAML
    events = detection_events(time.time() if t0 is None else t0)
    for e in events:
        if e["type"] == "sample":
            _detection_picture(e["index"], e["step"]).save(run / e["path"])
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "train.log").write_text("step 5: mAP 0.42 mAP50 0.61 on 8 images\n")
    return run
