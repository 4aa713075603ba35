"""The pieces behind the web UI, without a browser: the generated form, form <-> YAML sync, validation at the
field, the plan line, run folders -> runs list / progress / samples, presets, the dataset check, who may connect
(auth, host) and which paths may be typed in (workspace confinement); and that the UI never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from app import forms
from app.checks import check_values
from app.presets import Presets
from app.runs import (
    EventCache,
    all_samples,
    eval_series,
    latest_samples,
    list_runs,
    log_tail,
    per_class_rows,
    read_run,
    run_rows,
)
from app.security import Workspace, auth_from_env, check_exposure, parse_auth
from tests.browser_helpers import write_detection_run
from trainer.core.config.fields import help_of
from trainer.core.config.schema import iter_keys
from trainer.errors import UserError
from trainer.core.hardware import Hardware

REPO = Path(__file__).resolve().parents[1]
CPU = Hardware(cpu_count=2)
TWO_GPUS = Hardware(gpu_count=2, gpu_names=("GPU", "GPU"), bf16=True)
MAIN_SECTIONS = ("model", "data", "lora", "full", "prior", "batch", "train", "sample", "checkpoint")
MAIN_TOP_KEYS = ("name", "method", "seed", "devices", "precision")


def demo_values() -> dict:
    return Presets(Path("/nonexistent")).values("shipped/demo")


# ----------------------------------------------------------------------------------------------------------------
# The form, generated from the schema


def test_form_covers_every_key_of_the_main_groups_with_its_help_text():
    schema = {key: f for key, f in iter_keys()}
    expected = [k for k in schema if k.split(".")[0] in MAIN_SECTIONS or k in MAIN_TOP_KEYS]
    assert set(expected) <= set(forms.FORM_KEYS)
    for key in forms.FORM_KEYS:
        spec = forms.SPEC[key]
        assert spec.help and spec.help == " ".join(help_of(schema[key]).replace("`", "").split())
        assert spec.group in forms.GROUPS
    # Everything not in the form is still editable in the YAML, and nothing is in neither.
    assert set(forms.FORM_KEYS) | {k for k in schema if forms.is_yaml_only(k)} == set(schema)
    assert forms.SPEC["train.optimizer"].choices == tuple(schema["train.optimizer"].metadata["choices"])
    assert {forms.SPEC[k].group for k in ("model.path", "data.path", "lora.rank", "devices", "batch.total",
                                          "precision", "sample.every", "checkpoint.every")} == {
        "model", "data", "method", "batch", "precision", "sampling", "output"}


def test_form_widgets_carry_labels_help_and_ids():
    import gradio as gr

    from app.ui_form import build_form

    values = demo_values()
    with gr.Blocks():
        widgets = build_form(values)
    assert set(widgets.fields) == set(forms.FORM_KEYS) == set(widgets.errors)
    lr = widgets.fields["train.lr"]
    assert lr.info == forms.SPEC["train.lr"].help and "train.lr" in lr.label and lr.elem_id == "field-train-lr"
    assert isinstance(widgets.fields["data.flip"], gr.Checkbox) and widgets.fields["data.flip"].value is True
    assert isinstance(widgets.fields["train.scheduler"], gr.Dropdown)
    assert isinstance(widgets.fields["train.steps"], gr.Number) and widgets.fields["train.steps"].value == 300
    assert widgets.fields["sample.prompts"].value.splitlines() == values["sample.prompts"]
    assert set(widgets.panels) == {"lora", "full"}


# ----------------------------------------------------------------------------------------------------------------
# Form <-> values <-> YAML


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "presets").glob("*.yaml")))
def test_every_shipped_preset_survives_form_and_yaml_round_trips(preset):
    values = Presets(Path("/nonexistent")).values(f"shipped/{preset}")
    assert forms.from_yaml(forms.to_yaml(values)) == values
    widgets = [forms.to_widget(forms.SPEC[k], values[k]) for k in forms.FORM_KEYS]
    assert forms.form_update(values, widgets) == values


def test_a_form_edit_shows_in_the_yaml_and_a_yaml_edit_in_the_form():
    values = demo_values()
    widgets = {k: forms.to_widget(forms.SPEC[k], values[k]) for k in forms.FORM_KEYS}
    widgets.update({"train.lr": "2e-4", "devices": "cpu:2", "sample.prompts": "a cat\n\n a dog ", "train.steps": 50.0})
    edited = forms.form_update(values, [widgets[k] for k in forms.FORM_KEYS])
    text = forms.to_yaml(edited)
    assert "lr: 0.0002" in text and "devices: cpu:2" in text and "steps: 50\n" in text
    assert edited["sample.prompts"] == ["a cat", "a dog"]

    text = text.replace("rank: 8", "rank: 32").replace("total: 4", "total: 8")
    back = forms.from_yaml(text)
    assert back["lora.rank"] == 32 and back["batch.total"] == 8
    assert forms.to_widget(forms.SPEC["lora.rank"], back["lora.rank"]) == 32
    # A sparse YAML (like a preset) fills in the defaults; flow style works too.
    sparse = forms.from_yaml("{train: {steps: 40, lr: 1e-3}, devices: [0, 1]}")
    assert sparse["train.steps"] == 40 and sparse["train.lr"] == 0.001 and sparse["devices"] == [0, 1]
    assert sparse["lora.rank"] == forms.defaults()["lora.rank"]
    assert forms.to_widget(forms.SPEC["devices"], [0, 1]) == "[0, 1]"


def test_yaml_syntax_errors_and_unknown_keys_are_reported():
    with pytest.raises(forms.YamlError, match="YAML"):
        forms.from_yaml("train: {steps: 40\n  lr: [")
    with pytest.raises(forms.YamlError, match="mapping"):
        forms.from_yaml("- just a list")
    check = check_values(forms.from_yaml("trian: {steps: 3}\nmodel: {path: demo://tiny-sd}\n"
                                         "data: {path: demo://demo-data}"), CPU)
    assert any("trian.steps: unknown key" in p and "train.steps" in p for p in check.other_errors)


def test_a_yaml_parse_error_is_the_problem_next_to_start_not_what_an_earlier_text_parsed_to():
    """While the editor's text does not parse, the values the form last had (here a half-typed key) are not what
    the editor says: the only problem listed (and Start's refusal) is the parse error; the YAML written from the
    values never holds the marker."""
    half_typed = {**forms.from_yaml("model: {path: demo://tiny-sd}\ndata: {path: demo://demo-data}"), "tversion": 1}
    with pytest.raises(forms.YamlError) as caught:
        forms.from_yaml("tversion: 1\ntrain: {steps: 40\n")
    broken = forms.with_yaml_error(half_typed, str(caught.value))
    check = check_values(broken, CPU)
    assert not check.ok and check.problem_count == 1 and not check.field_errors
    assert check.other_errors[0].startswith("YAML: ") and "Fix the YAML editor's text" in check.other_errors[0]
    assert "tversion" not in check.other_errors[0] and forms.YAML_ERROR not in forms.to_yaml(broken)
    assert forms.without_yaml_error(broken) == half_typed


def test_widget_text_converts_to_typed_values():
    spec = forms.SPEC
    assert forms.from_widget(spec["train.lr"], "1e-4") == 1e-4
    assert forms.from_widget(spec["train.lr"], "abc") == "abc"  # left for the engine to name the key
    assert forms.from_widget(spec["train.min_snr_gamma"], "") is None
    assert forms.from_widget(spec["batch.per_device"], "auto") == "auto"
    assert forms.from_widget(spec["batch.per_device"], "2") == 2
    assert forms.from_widget(spec["devices"], "[0, 2]") == [0, 2]
    assert forms.from_widget(spec["train.betas"], "0.9, 0.99") == [0.9, 0.99]
    assert forms.from_widget(spec["data.instance_prompt"], "") is None
    assert forms.from_widget(spec["data.cache_text_embeddings"], "default") is None
    assert forms.from_widget(spec["data.cache_text_embeddings"], "yes") is True
    assert forms.from_widget(spec["train.steps"], 40.0) == 40


# ----------------------------------------------------------------------------------------------------------------
# Validation at the field, and the plan line


def test_errors_are_attached_to_their_fields_and_the_plan_waits_for_valid_devices():
    values = {**demo_values(), "train.lr": -1.0, "data.resolution": 30}
    check = check_values(values, CPU)
    assert not check.ok
    assert "must be greater than zero" in check.error_text("train.lr")
    assert "multiple of 8" in check.error_text("data.resolution")
    assert check.plan is not None  # unrelated mistakes do not hide the plan
    assert check.plan.line() == "1 process x 2 per device x accumulation 2 = batch 4 · fp32 · sdpa · cpu"

    check = check_values({**demo_values(), "devices": 3}, TWO_GPUS)
    assert "asks for 3 GPUs" in check.error_text("devices") and check.plan is None
    check = check_values({**demo_values(), "train.steps": None}, CPU)
    assert check.error_text("train.steps") == "needs a value"


def test_plan_line_follows_devices_and_batch():
    values = {**demo_values(), "devices": 2, "batch.total": 16, "batch.per_device": 2}
    check = check_values(values, TWO_GPUS)
    assert check.ok
    assert check.plan.line() == "2 processes x 2 per device x accumulation 4 = batch 16 · bf16 · sdpa · gpu 0,1"
    check = check_values({**values, "devices": "cpu:2", "batch.total": 8}, TWO_GPUS)
    assert check.plan.line() == "2 processes x 2 per device x accumulation 2 = batch 8 · fp32 · sdpa · cpu"
    # The hardware is not known yet: a GPU plan waits, a CPU plan does not need it.
    assert check_values({**values, "devices": "auto"}, lambda config: None).waiting_for_hardware
    from app.jobs import HardwareCache

    cache = HardwareCache(probe=lambda: time.sleep(30) or CPU)
    assert check_values({**values, "devices": "cpu:1"}, cache.for_config).plan is not None


# ----------------------------------------------------------------------------------------------------------------
# Run folders -> the Runs page


def write_run(root: Path, name: str, events: list[dict], config: dict | None = None, pid: int | None = None) -> Path:
    run = root / name
    (run / "samples").mkdir(parents=True)
    cfg = config or {"model": {"family": "sd"}, "method": "lora", "train": {"steps": 10}}
    (run / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    t0 = 1_700_000_000.0
    (run / "events.jsonl").write_text("".join(json.dumps({"time": t0 + i, **e}) + "\n" for i, e in enumerate(events)))
    for e in events:
        if e["type"] == "sample":
            Image.new("RGB", (8, 8), (200, 0, 0)).save(run / e["path"])
    if pid is not None:
        (run / "launcher.pid").write_text(f"{pid}\n")
    (run / "train.log").write_text("".join(f"line {i}\n" for i in range(100)) + "a\rb\x1b[A\n")
    return run


PLAN = {"type": "plan", "line": "1 process x 1 per device x accumulation 1 = batch 2 · fp32 · sdpa · cpu",
        "total": 2, "steps": 10, "notes": ["a note"]}


def progress(step, loss, lr=1e-3, steps=10):
    return {"type": "progress", "step": step, "steps": steps, "loss": loss, "lr": lr, "samples_per_s": 4.0, "eta_s": 30}


def sample(step, index, prompt):
    return {"type": "sample", "step": step, "prompt": prompt, "index": index,
            "path": f"samples/step-{step:06d}-p{index:02d}.png"}


def test_a_hand_made_run_folder_reads_into_the_runs_page(tmp_path):
    run = write_run(tmp_path, "stopped-then-failed", [
        PLAN, sample(0, 0, "a cat"), sample(0, 1, "a dog"), progress(1, 0.9), progress(2, 0.8),
        sample(2, 0, "a cat"), progress(3, 0.7), {"type": "checkpoint", "step": 3, "path": "checkpoints/step-000003"},
        {"type": "stopped", "step": 3, "checkpoint": "checkpoints/step-000003"},
        {"type": "resumed", "step": 2, "line": "2 processes x 1 per device x accumulation 1 = batch 2 · fp32 · sdpa · cpu",
         "plan": {"total": 2, "steps": 12, "notes": []}},
        progress(3, 0.65, steps=12), {"type": "warning", "message": "img.png: no caption; skipped"},
        {"type": "failed", "reason": "Rank 0 was killed by SIGKILL. Lower batch.per_device."},
    ])
    view = read_run(run, EventCache())
    assert view.status == "failed" and "SIGKILL" in view.final.reason
    assert (view.step, view.steps, view.family, view.method) == (3, 12, "sd", "lora")
    assert view.losses == {1: 0.9, 2: 0.8, 3: 0.65}  # a step trained again after resuming replaces the old point
    assert view.it_per_s == pytest.approx(2.0)  # samples/s over the batch
    assert view.plan_line.startswith("2 processes") and view.warnings == ["img.png: no caption; skipped"]
    assert [c for _, c in latest_samples(view)] == ["step 2 · a cat", "step 0 · a dog"]
    assert [c for _, c in all_samples(view)] == ["step 2 · a cat", "step 0 · a cat", "step 0 · a dog"]
    assert all(Path(p).is_file() for p, _ in all_samples(view))
    assert log_tail(run, 3).splitlines() == ["line 99", "a", "b"]

    done = write_run(tmp_path, "done", [PLAN, progress(10, 0.5), {"type": "done", "step": 10, "outputs": ["output/x"]}])
    rows = {r[0]: r for r in run_rows(list_runs(tmp_path))}
    assert rows["done"][3:6] == ["done", "10/10", "0.5000"]
    assert rows["stopped-then-failed"][3] == "failed"
    assert read_run(done).status == "done"


def test_run_status_comes_from_the_folder(tmp_path):
    running = write_run(tmp_path, "running", [PLAN, progress(1, 1.0)], pid=os.getpid())
    assert read_run(running).status == "running"
    (running / "STOP").touch()
    assert read_run(running).status == "stopping"
    # The workers wrote `stopped` but torchrun has not exited yet: not resumable until it has.
    ending = write_run(tmp_path, "ending", [PLAN, {"type": "stopped", "step": 1, "checkpoint": None}], pid=os.getpid())
    assert read_run(ending).status == "stopping" and read_run(ending).active
    (ending / "launcher.pid").unlink()
    assert read_run(ending).status == "stopped"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = write_run(tmp_path, "orphan", [PLAN, progress(1, 1.0)], pid=dead.pid)
    assert read_run(orphan).status == "unknown"  # its processes are gone without a final event
    assert sorted(v.name for v in list_runs(tmp_path)) == ["ending", "orphan", "running"]
    assert not (tmp_path / ".demo").exists() and all(v.name != ".demo" for v in list_runs(tmp_path))


def test_event_cache_reads_only_complete_new_lines(tmp_path):
    run = write_run(tmp_path, "r", [PLAN])
    cache = EventCache()
    assert len(cache.events(run)) == 1
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps(progress(1, 1.0)) + "\n" + '{"type": "progr')
    assert [e.kind for e in cache.events(run)] == ["plan", "progress"]
    with open(run / "events.jsonl", "a") as f:
        f.write('ess", "step": 2, "loss": 0.5}\n')
    assert [getattr(e, "step", None) for e in cache.events(run)] == [None, 1, 2]
    (run / "events.jsonl").write_text(json.dumps(PLAN) + "\n")  # rewritten: read again from the start
    assert len(cache.events(run)) == 1


def test_the_run_view_shows_each_ranks_figures_and_marks_the_lagging_one(tmp_path):
    from app import ui_runs

    figures = [{"rank": 0, "step_s": 0.5, "data_s": 0.01, "forward_s": 0.2, "sync_s": 0.3, "cpu_s": 0.5,
                "rss_mb": 900.0, "peak_rss_mb": 950.0},
               {"rank": 1, "step_s": 0.5, "data_s": 0.26, "forward_s": 0.2, "sync_s": 0.0, "cpu_s": 0.2,
                "rss_mb": 800.0, "peak_rss_mb": 810.0}]
    run = write_run(tmp_path, "r", [PLAN, progress(1, 0.9),
                                    {**progress(2, 0.8), "ranks_step": 1, "ranks": figures, "slowest_rank": 1}])
    view = read_run(run, EventCache())
    page = ui_runs.progress_html(view)
    assert "per rank, step 1" in page and "<td>0.260</td>" in page and "<td>900</td>" in page
    assert "<tr class='slowest' data-rank='1'>" in page and "rank 1 lags" in page
    assert "GPU" not in page  # CPU ranks: no device columns
    planted = write_run(tmp_path, "bad", [PLAN, {**progress(1, 0.9), "ranks": [{"rank": 0, "step_s": "<b>"}]}])
    assert read_run(planted, EventCache()).status == "unreadable"


def test_the_run_header_links_the_tensorboard_folder_and_the_hub_repo_and_escapes_them(tmp_path):
    from app import ui_runs

    run = write_run(tmp_path, "r", [PLAN, {"type": "done", "step": 10, "outputs": [],
                                           "hub": "https://huggingface.co/me/x?a=<b>&c"}])
    assert "TensorBoard" not in ui_runs.header_html(read_run(run, EventCache()))
    (run / "tensorboard").mkdir()
    head = ui_runs.header_html(read_run(run, EventCache()))
    assert f"tensorboard --logdir {run / 'tensorboard'}" in head
    assert 'href="https://huggingface.co/me/x?a=&lt;b&gt;&amp;c"' in head
    planted = write_run(tmp_path, "p", [PLAN, {"type": "done", "step": 1, "outputs": [], "hub": "javascript:x()"}])
    assert "Hub:" not in ui_runs.header_html(read_run(planted, EventCache()))


def test_a_killed_run_says_it_was_killed_and_where_it_can_go_on_from(tmp_path):
    """Kill is confirmed first, naming what it loses; afterwards the page says Kill ended it and names the
    checkpoint Resume would use only if there is one (no "UI restarted", no checkpoint that does not exist)."""
    import subprocess
    import sys

    from app import ui_runs
    from app.jobs import HardwareCache, Jobs
    from trainer.core.launcher import kill_run
    from trainer.core.runlock import identity

    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    # A run whose launcher is another process that does not write an ending (a UI restarted since it started it).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        run = write_run(tmp_path, "k", [PLAN, progress(1, 0.9)])
        (run / "launcher.pid").write_text(identity(sleeper.pid))
        shown, text = ui_runs.ask_kill(ctx, "k")
        assert shown["visible"] is True and "Kill run **k** now?" in text and "no checkpoint yet" in text
        assert kill_run(run, grace_s=5) and sleeper.wait(timeout=10) is not None
    finally:
        sleeper.kill()
    view = read_run(run, EventCache())
    assert view.status == "failed" and view.final.killed
    box = ui_runs.failed_html(view)
    assert "<b>Killed</b>" in box and "saved no checkpoint" in box and "restarted" not in box
    assert "Resume</b> continues" not in box and "Fix what it names" not in box


    # With a checkpoint on disk, both the confirmation and the box name it.
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "checkpoints" / "step-000003" / "COMPLETE").write_text("")
    assert "newest checkpoint is step 3" in ui_runs.ask_kill(ctx, "k")[1]
    assert "<code>checkpoints/step-000003</code> (step 3)" in ui_runs.failed_html(read_run(run, EventCache()))
    # A run whose processes vanished without a word: told so, without guessing a UI restart.
    gone = read_run(write_run(tmp_path, "gone", [PLAN, progress(1, 0.9)]), EventCache())
    assert gone.status == "unknown" and "restarted" not in ui_runs.failed_html(gone)
    assert "saved no checkpoint" in ui_runs.failed_html(gone)


def test_a_run_a_terminal_waits_on_ends_once_when_the_ui_kills_it(tmp_path):
    """Kill from the UI of a run started in a terminal: the terminal's launcher, waiting on its workers, and the
    UI's kill both see the workers end without an ending. The run gets one `failed`, and it says Kill ended it
    (not "exited with signal 15" from the terminal's side, and not two endings)."""
    import threading

    from trainer.core.events import FINAL_TYPES, read_events
    from trainer.core.launcher import RunProcess, kill_run
    from trainer.core.plan import Plan
    from trainer.core.runlock import identity

    run = write_run(tmp_path, "t", [PLAN, progress(1, 0.9)])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    plan = Plan(device="cpu", gpu_ids=(), nodes=1, processes_per_node=1, per_device=2, accumulation=1, total=2,
                precision="fp32", attention="sdpa", steps=10)
    terminal = RunProcess(run, plan, worker)  # what `python launch.py --preset ...` waits on
    ending: dict = {}
    try:
        (run / "launcher.pid").write_text(identity(worker.pid))
        waiter = threading.Thread(target=lambda: ending.update(terminal.wait()))
        waiter.start()
        assert kill_run(run, grace_s=5)
        waiter.join(timeout=30)
    finally:
        worker.kill()
    finals = [e for e in read_events(run) if e["type"] in FINAL_TYPES]
    assert len(finals) == 1 and finals[0]["killed"] is True, finals
    assert "killed on request" in finals[0]["reason"] and ending == finals[0]


def test_a_poll_never_moves_the_pages_selection_unless_its_run_is_gone(tmp_path, monkeypatch):
    """A tick sent before the page's load picked its run (no run named) may answer after it on a busy machine: it
    updates the list of runs but leaves the selection, which cleared it for good before ("No run selected" beside
    a running run, on CI). A selected run deleted meanwhile is unselected."""
    import shutil

    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    run = write_run(tmp_path, "r", [PLAN, progress(1, 0.9)])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    monkeypatch.setattr(ui_runs.SHARED, "fresh_s", 0)  # each tick renders what is on disk now
    select = ui_runs.OUTPUT_NAMES.index("select")
    early = ui_runs.tick(ctx, None, {})[select]
    assert early["choices"] and "value" not in early
    assert "value" not in ui_runs.tick(ctx, "r", {})[select]  # the page's own choice stays the page's
    shutil.rmtree(run)
    assert ui_runs.tick(ctx, "r", {})[select]["value"] is None


def test_runs_page_sends_only_what_changed(tmp_path):
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    write_run(tmp_path, "r", [PLAN, sample(0, 0, "a cat"), progress(1, 0.9)])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    data = ui_runs.snapshot(ctx, "r")
    assert "step <b class='step' data-step='1'>1</b> / 10" in data["progress"] and "loss 0.9000" in data["progress"]
    # ended without a final event, no pid: resumable
    assert [data[b] for b in ("stop", "resume", "delete", "kill")] == [False, True, True, False]
    done = write_run(tmp_path, "d", [PLAN, progress(10, 0.5), {"type": "done", "step": 10, "outputs": []}])
    (done / "output" / "diffusers").mkdir(parents=True)
    (done / "output" / "pytorch_lora_weights.safetensors").write_bytes(b"x" * 10)
    assert ui_runs.snapshot(ctx, "d")["outputs"] == (str(done / "output" / "pytorch_lora_weights.safetensors"),)
    write_run(tmp_path, "f", [PLAN, {"type": "failed", "reason": "Rank 1 ran out of memory <here>."}])
    assert "Rank 1 ran out of memory &lt;here&gt;." in ui_runs.snapshot(ctx, "f")["failed"]
    assert ui_runs.snapshot(ctx, "d")["failed"] == ""
    data = ui_runs.snapshot(ctx, "r")
    first = ui_runs.render(data, {})
    assert all(u != {"__type__": "update"} for u in first[:5])
    again = ui_runs.render(ui_runs.snapshot(ctx, "r"), first[-1])
    assert all(u == {"__type__": "update"} for u in again[:-1])  # gr.skip() everywhere


def test_samples_show_as_a_grid_of_prompts_down_and_steps_across(tmp_path):
    from app.sample_grid import grid_html

    run = write_run(tmp_path, "g", [PLAN, sample(0, 0, "a <cat>"), sample(0, 1, "a dog"), sample(2, 0, "a <cat>"),
                                    {"type": "sample", "step": 4, "prompt": "a dog", "index": 1,
                                     "path": "samples/missing.png"}])
    (run / "samples" / "missing.png").unlink()
    grid = grid_html(read_run(run, EventCache()))
    # Two prompts (rows) x the steps whose images exist (columns, oldest first); a prompt not drawn at a step
    # leaves its cell empty; a file not (yet) on disk is not a column.
    assert grid.count('class="grid-prompt"') == 2 and [s for s in ("0", "2", "4") if f'data-step="{s}"' in grid] == \
        ["0", "2"]
    assert grid.index("a &lt;cat&gt;") < grid.index("a dog") and grid.count('class="grid-empty"') == 1
    # Each image comes from Gradio's file route under the run folder (a page-relative URL) and enlarges on click.
    assert f'src="gradio_api/file={run}/samples/' in grid and grid.count('class="grid-zoom"') == 3
    assert 'href="#sample-g-2-0"' in grid and 'id="sample-g-2-0"' in grid
    assert grid_html(read_run(write_run(tmp_path, "none", [PLAN, progress(1, 0.9)]), EventCache())) == ""


def test_plots_count_steps_in_whole_numbers_over_the_planned_run(tmp_path):
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    write_run(tmp_path, "r", [PLAN, progress(1, 0.9), progress(2, 0.8)])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    updates = ui_runs.by_name(ui_runs.render(ui_runs.snapshot(ctx, "r"), {}))
    # Drawn from the first points, over the whole planned run (10 steps), so the axis does not rescale each tick.
    assert updates["loss_plot"]["visible"] is True and updates["loss_plot"]["x_lim"] == [0, 10]
    assert updates["lr_plot"]["x_lim"] == [0, 10] and updates["eval_plot"]["visible"] is False
    assert ui_runs.X_FORMAT == "d" and ui_runs.x_lim(3) is None  # no repeated step numbers


def test_sessions_share_one_render_per_folder_state_and_long_plots_are_thinned(tmp_path, monkeypatch):
    from app import runs as R
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    write_run(tmp_path, "r", [PLAN, *(progress(s, 1.0 / s) for s in range(1, 1301))])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    made = []
    real = ui_runs.snapshot
    monkeypatch.setattr(ui_runs, "snapshot", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(ui_runs, "SHARED", ui_runs.SharedRenders())
    sessions = [ui_runs.refresh(ctx, "r", {}) for _ in range(20)]
    assert len(made) == 1 and all(s[-1] == sessions[0][-1] for s in sessions[1:])  # one render, 20 pages
    # 1300 steps reach the browser as at most 600 points a line, the last step kept.
    frame = ui_runs.by_name(sessions[0])["loss_plot"]["value"]
    per_step = frame[frame.series == "per step"]
    assert len(per_step) <= R.PLOT_POINTS + 1 and per_step.step.max() == 1300 and per_step.step.min() == 1
    assert R.thin({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}
    with open(tmp_path / "r" / "events.jsonl", "a") as f:  # a training step: the folder changes
        f.write(json.dumps(progress(1301, 0.1)) + "\n")
    monkeypatch.setattr(ui_runs.SHARED, "fresh_s", 3600.0)  # polls within fresh_s share the last snapshot...
    polled = [ui_runs.tick(ctx, "r", s[-1]) for s in sessions]
    assert len(made) == 1 and all(p[-1]["fingerprint"] == sessions[0][-1]["fingerprint"] for p in polled)
    monkeypatch.setattr(ui_runs.SHARED, "fresh_s", 0.0)  # ...and catch up after it, rendering once for all
    again = [ui_runs.tick(ctx, "r", p[-1]) for p in polled]
    assert len(made) == 2 and "1301" in ui_runs.by_name(again[0])["progress"]


def test_a_stale_response_landing_last_is_corrected_by_the_next_tick(tmp_path, monkeypatch):
    """Responses can land out of order (a queued Stop's refresh after a later tick's): the page must not stay on
    the stale one. The fingerprint travels in `seen`, so the next tick compares with what is on screen."""
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    monkeypatch.setattr(ui_runs.SHARED, "fresh_s", 0.0)  # ticks a poll apart (a shared snapshot is reused 1 s)
    run = write_run(tmp_path, "r", [PLAN, progress(1, 0.9)])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    header = ui_runs.OUTPUT_NAMES.index("header")
    stale = ui_runs.refresh(ctx, "r", {})  # rendered while the run was at step 1
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "stopped", "step": 1, "checkpoint": None}) + "\n")
    latest = ui_runs.tick(ctx, "r", stale[-1])  # the tick that saw it end
    assert "stopped" in latest[header]
    assert all(u == {"__type__": "update"} for u in ui_runs.tick(ctx, "r", latest[-1]))  # nothing new: skipped
    corrected = ui_runs.tick(ctx, "r", stale[-1])  # the stale response landed last: the screen shows it
    assert "stopped" in corrected[header]


@pytest.fixture
def detection_run(tmp_path):
    """runs/detector/ of a detection fine-tune (synthetic events, no torch) evaluated at steps 5 and 10, done;
    step 5 is the best. Samples: two validation images and the precision-recall curve at each evaluation."""
    return write_detection_run(tmp_path / "runs", "detector")


def test_detection_runs_show_map_per_class_ap_and_the_best_step(detection_run):
    view = read_run(detection_run, EventCache())
    assert (view.status, view.family, sorted(view.evals)) == ("done", "detection", [5, 10])
    assert view.best.step == 5 and view.best.metric == "map"
    assert eval_series(view) == [(5, "mAP", 0.42), (5, "mAP50", 0.61), (10, "mAP", 0.4), (10, "mAP50", 0.58)]
    assert per_class_rows(view.evals[10]) == [("circle", 0.5, 0.75), ("square", 0.3, 0.41), ("<tri>", None, None)]

    # The gallery: the prediction samples and the precision-recall curve of the latest evaluation, side by side.
    latest = [c for _, c in latest_samples(view)]
    assert latest[0].startswith("step 10 · val image 0") and latest[1].startswith("step 10 · val image 1")
    assert latest[2] == "step 10 · precision-recall curve (IoU 0.5), mAP50 0.58"
    assert len(all_samples(view)) == 6

    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    ctx = type("Ctx", (), {"jobs": Jobs(detection_run.parent, HardwareCache(hw=CPU))})()
    data = ui_runs.snapshot(ctx, "detector")
    assert data["eval_plot"][0] == tuple(eval_series(view))
    box = data["eval_info"]
    assert "step <b class=\"eval-step\">10</b> on 8 validation images" in box
    assert "mAP <b>0.400</b> · mAP50 <b>0.580</b> · mAP75 <b>0.360</b> · mAR100 <b>0.464</b>" in box
    assert "Best so far: step <b>5</b> (mAP 0.420)" in box and "checkpoints/best/" in box
    assert "<td>circle</td><td>0.500</td><td>0.750</td>" in box
    assert "<td>&lt;tri&gt;</td><td>–</td><td>–</td>" in box  # a class without ground truth: no AP, escaped
    # The grid: the two validation images and the curve down, the two evaluated steps across.
    assert data["every"].count('class="grid-prompt"') == 3 and data["every"].count('class="grid-step"') == 2
    updates = ui_runs.by_name(ui_runs.render(data, {}))
    assert updates["eval_plot"]["visible"] is True and list(updates["eval_plot"]["value"].columns) == \
        ["step", "metric", "value"]
    assert updates["eval_info"]["visible"] is True and updates["eval_info"]["value"] == box


def test_runs_without_evaluations_show_no_evaluation_row(tmp_path):
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs

    write_run(tmp_path, "sd", [PLAN, progress(1, 0.9), sample(1, 0, "a cat")])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=CPU))})()
    data = ui_runs.snapshot(ctx, "sd")
    assert data["eval_plot"][0] == () and data["eval_info"] == ""
    updates = ui_runs.by_name(ui_runs.render(data, {}))
    assert updates["eval_plot"]["visible"] is False and updates["eval_info"]["visible"] is False
    # An evaluation without a best metric or classes (another family's metrics) still shows its numbers.
    run = write_run(tmp_path, "other", [PLAN, {"type": "eval", "step": 4, "fid": 31.5, "note": "x"}])
    view = read_run(run, EventCache())
    assert eval_series(view) == [(4, "fid", 31.5)]
    assert "fid <b>31.500</b>" in ui_runs.eval_html(view) and "Best" not in ui_runs.eval_html(view)


# ----------------------------------------------------------------------------------------------------------------
# Presets


def test_presets_list_demo_first_and_save_sparse_user_presets(tmp_path):
    presets = Presets(tmp_path / "user")
    ids = [pid for _, pid in presets.choices()]
    assert ids[0] == "shipped/demo" and all(pid.startswith("shipped/") for pid in ids)
    assert "offline demo" in presets.description("shipped/demo")
    shipped_before = {p: p.read_bytes() for p in (REPO / "presets").glob("*.yaml")}

    values = {**presets.values("shipped/demo"), "train.steps": 77, "name": "mine"}
    preset_id = presets.save("my-demo", values)
    assert preset_id == "user/my-demo" and ("my-demo  ·  yours", "user/my-demo") in presets.choices()
    text = (tmp_path / "user" / "my-demo.yaml").read_text()
    assert "steps: 77" in text and "distributed" not in text and "center_crop" not in text  # sparse
    assert presets.values(preset_id) == values
    with pytest.raises(UserError):
        presets.save("../escape", values)
    with pytest.raises(UserError):
        presets.values("shipped/../../etc/passwd")
    assert {p: p.read_bytes() for p in (REPO / "presets").glob("*.yaml")} == shipped_before


# ----------------------------------------------------------------------------------------------------------------
# Dataset check


def test_the_dataset_check_reads_the_folder_at_the_run_settings_resolution(tmp_path):
    """Fields left empty in the Dataset check tab are the New run tab's: the demo's 64 px images are not all
    "smaller than the resolution" (a fixed 512 flagged every one); a typed value still wins."""
    from app.dataset_check import check_dataset
    from app.dataset_check import filled

    values = {**demo_values(), "data.path": str(tmp_path)}
    for i in range(2):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text("a yellow circle")
    args = filled("", "", "", None, values)
    assert args == (str(tmp_path), values["data.instance_prompt"] or "", ".txt", 64)
    report = check_dataset(*args)
    assert "**2 images**" in report.summary_md and "smaller than the resolution" not in report.problems_html
    assert filled("other", "a dog", ".caption", 512, values) == ("other", "a dog", ".caption", 512)
    assert "smaller than the resolution 512" in check_dataset(*filled("", "", "", 512, values)).problems_html


def test_dataset_check_reports_counts_repeats_and_problems(tmp_path):
    from app.dataset_check import check_dataset

    data = tmp_path / "data"
    (data / "10_sks dog").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (640, 512), (i * 50, 0, 0)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(f"caption {i}")
    Image.new("RGB", (256, 256)).save(data / "10_sks dog" / "dog.jpg")
    Image.new("RGB", (300, 300)).save(data / "uncaptioned.png")
    (data / "broken.png").write_bytes(b"not a png")
    report = check_dataset(str(data), resolution=512)
    assert report.scan.image_count == 4
    assert "**4 images**" in report.summary_md and "13 per epoch" in report.summary_md
    assert "| 10_sks dog | 10 | 1 |" in report.summary_md
    assert "broken.png" in report.problems_html and "uncaptioned.png" in report.problems_html
    assert len(report.gallery) == 4 and report.gallery[0][1] == "sks dog  ·  dog.jpg 256×256 · ×10"
    missing = check_dataset(str(tmp_path / "nope"))
    assert "Training would not start" in missing.problems_html and "does not exist" in missing.problems_html
    outside = check_dataset("/etc", workspace=Workspace(tmp_path, confined=True))
    assert "outside the workspace" in outside.problems_html


# ----------------------------------------------------------------------------------------------------------------
# Who may connect, which paths may be typed


def test_an_exposed_ui_without_a_login_makes_one_and_says_it_once():
    from app.security import login_for

    said = []
    assert login_for("127.0.0.1", False, None, False, say=said.append) is None and not said  # this machine only
    assert login_for("0.0.0.0", False, ("me", "a-long-password"), False, say=said.append) == ("me", "a-long-password")
    assert login_for("0.0.0.0", False, None, True, say=said.append) is None and not said  # --insecure
    user, password = login_for("0.0.0.0", False, None, False, say=said.append)
    other = login_for("0.0.0.0", False, None, False, say=said.append)[1]
    assert len(password) >= 24 and password != other and len(said) == 2 and password in said[0]
    check_exposure("0.0.0.0", False, (user, password), False)  # strong enough for the exposure rules


def test_serving_beyond_this_machine_needs_a_login():
    check_exposure("127.0.0.1", False, None, False)
    for host, share in (("0.0.0.0", False), ("192.168.1.5", False), ("127.0.0.1", True)):
        with pytest.raises(UserError, match="--auth user:password"):
            check_exposure(host, share, None, False)
        check_exposure(host, share, ("u", "a-long-password"), False)
        with pytest.raises(UserError, match="at least 12"):
            check_exposure(host, share, ("u", "p"), False)  # guessable: tests/test_security.py tries more
        check_exposure(host, share, None, True)  # --insecure: the user said the network is trusted
    assert auth_from_env(None, {"IMAGETUNE_AUTH": "ann:secret"}) == ("ann", "secret")
    assert auth_from_env(("a", "b"), {"IMAGETUNE_AUTH": "ann:secret"}) == ("a", "b")
    assert auth_from_env(None, {}) is None
    with pytest.raises(UserError):
        parse_auth("nopassword")


def test_main_refuses_a_guessable_password_on_an_exposed_host_before_building_anything(monkeypatch, tmp_path):
    import app.main

    monkeypatch.setenv("IMAGETUNE_AUTH", "me:short")
    with pytest.raises(UserError, match="at least 12"):
        app.main.main(host="0.0.0.0", port=1, runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
    result = subprocess.run([sys.executable, "launch.py", "--host", "0.0.0.0", "--runs-dir", str(tmp_path / "r")],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "IMAGETUNE_AUTH": "me:short"})
    assert result.returncode == 2 and "IMAGETUNE_AUTH" in result.stderr and "Traceback" not in result.stderr
    assert "short" not in result.stderr  # the password itself is never echoed


def test_workspace_confinement_rejects_paths_outside_the_root(tmp_path):
    root = tmp_path / "workspace"
    (root / "data").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    ws = Workspace(root, confined=True)
    assert ws.problem("data.path", str(root / "data")) is None
    assert "outside the workspace" in ws.problem("data.path", "/etc")
    assert "outside the workspace" in ws.problem("data.path", str(root / "data" / ".." / ".."))
    assert "outside the workspace" in ws.problem("data.path", str(root / "escape"))  # symlinks are followed
    assert ws.problem("model.path", "stable-diffusion-v1-5/stable-diffusion-v1-5") is None  # a hub id
    assert ws.problem("model.path", "demo://tiny-sd") is None
    with pytest.raises(UserError):
        ws.check("data.path", "/etc")
    assert Workspace(root, confined=False).problem("data.path", "/etc") is None  # local use: any path
    check = check_values({**demo_values(), "data.path": "/etc"}, CPU, ws)
    assert "outside the workspace" in check.error_text("data.path") and not check.ok
    assert Workspace.for_server("0.0.0.0", False, root).confined
    assert not Workspace.for_server("127.0.0.1", False, root).confined


def test_runs_are_only_addressed_inside_the_runs_folder(tmp_path):
    from app.jobs import HardwareCache, Jobs

    jobs = Jobs(tmp_path / "runs", HardwareCache(hw=CPU))
    write_run(tmp_path / "runs", "r", [PLAN, {"type": "stopped", "step": 1, "checkpoint": None}])
    (tmp_path / "outside").mkdir()
    for name in ("../outside", "", "/etc", "nope"):
        with pytest.raises(UserError):
            jobs.run_dir(name)
    running = write_run(tmp_path / "runs", "busy", [PLAN], pid=os.getpid())
    with pytest.raises(UserError, match="still running"):
        jobs.delete("busy")
    jobs.delete("r")
    assert not (tmp_path / "runs" / "r").exists() and running.exists()


# ----------------------------------------------------------------------------------------------------------------
# The UI process stays torch-free, and the page builds


def test_the_ui_never_imports_torch():
    code = ("import sys, app.main, app.ui, app.jobs, app.runs, app.dataset_check; "
            "print(','.join(m for m in ('torch', 'diffusers', 'transformers', 'accelerate') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_page_builds_with_every_part(tmp_path):
    from app.jobs import HardwareCache
    from app.security import Workspace
    from app.ui import build_ui, make_context

    ctx = make_context(tmp_path / "runs", tmp_path / "home", Workspace(tmp_path), HardwareCache(hw=CPU))
    blocks = build_ui(ctx)
    ids = {getattr(b, "elem_id", None) for b in blocks.blocks.values()}
    for elem_id in ("preset", "plan-line", "start-button", "yaml-editor", "run-select", "run-progress", "loss-plot",
                    "lr-plot", "eval-plot", "run-eval", "samples-all", "stop-button", "resume-button", "delete-button",
                    "run-outputs", "run-log", "dataset-path", "dataset-gallery", "field-train-lr", "err-train-lr",
                    "hub-repo", "hub-push"):
        assert elem_id in ids, elem_id


def test_the_loss_plot_shows_a_smoothed_trend_under_the_noisy_per_step_losses():
    from app.runs import smoothed
    from app.ui_runs import _loss_frame

    noisy = {1: 1.0, 2: 0.2, 3: 1.0, 4: 0.2, 5: 1.0, 6: 0.2}
    trend = smoothed(noisy, weight=0.5)
    assert trend[1] == 1.0  # bias-corrected: the first point is the first loss, not pulled towards zero
    assert all(0.2 < trend[s] < 1.0 for s in range(2, 7))  # between the extremes the raw line jumps to
    later = [trend[s] for s in range(3, 7)]
    assert max(later) - min(later) < 0.5 * (max(noisy.values()) - min(noisy.values()))  # the jumps damped
    falling = {s: 2.0 - 0.1 * s + (0.3 if s % 2 else -0.3) for s in range(1, 21)}
    smooth = smoothed(falling)
    assert smooth[20] < smooth[10] < smooth[2]  # follows the trend
    frame = _loss_frame(noisy)
    assert sorted(set(frame["series"])) == ["per step", "smoothed"] and len(frame) == 12


@pytest.mark.parametrize("after, shown", [
    ([], True),  # nothing answered it yet: the run may really be stuck
    ([{"type": "progress", "step": 4, "steps": 10, "loss": 0.1}], False),  # it stepped again
    ([{"type": "stopped", "step": 3}], False),  # it ended (a stall that ends a run is the `failed` reason)
    ([{"type": "resumed", "step": 3, "plan": {}}], False),  # a new launch
])
def test_a_stall_warning_shows_only_until_the_run_moves_on_or_ends(tmp_path, after, shown):
    from app.ui_runs import header_html

    stall = "No step for 210 s. rank 0 alive but finishing no step (a deadlock?): rank 0 (at step, last step 3)."
    events = [{"type": "plan", "line": "1 process", "total": 1},
              {"type": "progress", "step": 3, "steps": 10, "loss": 0.2},
              {"type": "warning", "message": "disk nearly full"}, {"type": "warning", "message": stall}, *after]
    view = read_run(write_run(tmp_path, "r", events))
    assert ("a deadlock?" in header_html(view)) == shown
    assert "disk nearly full" in header_html(view)  # other warnings stay
