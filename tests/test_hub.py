"""output.push_to_hub: a finished run's outputs, last samples and model card uploaded through huggingface_hub, to
tests/fake_hub.py's server on 127.0.0.1 (HF_ENDPOINT): NOT the real Hub, nothing leaves this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_imagetuneTestTokenNeverWritten"
OVERRIDES = ["devices=cpu:1", "precision=fp32", "train.warmup_steps=0", "sample.steps=2",
             "sample.images_per_prompt=1", "checkpoint.every=0", "lora.train_text_encoder=false"]


def _train(tmp_path: Path, hub: FakeHub, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0"}
    result = subprocess.run([sys.executable, str(REPO / "launch.py"), "--preset", "demo", "--runs-dir",
                             str(tmp_path / "runs"), *OVERRIDES, *overrides], env=env, capture_output=True,
                            text=True, timeout=600)
    return result, tmp_path / "runs" / "demo"


def _everything_written(run_dir: Path, result: subprocess.CompletedProcess) -> bytes:
    return b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file()) + \
        (result.stdout + result.stderr).encode()


@pytest.mark.slow
def test_a_done_run_uploads_its_outputs_samples_and_card_with_the_token_from_the_environment(tmp_path):
    with FakeHub() as hub:
        result, run_dir = _train(tmp_path, hub, "train.steps=4", "sample.every=2", "output.push_to_hub=me/sks-circle")
    assert result.returncode == 0, result.stderr[-3000:]
    done = read_events(run_dir)[-1]
    assert done["type"] == "done" and done["hub"] == f"{hub.url}/me/sks-circle"
    repo = hub.repos["me/sks-circle"]
    assert repo["private"]  # a new repo is private: the user publishes it
    files = repo["files"]
    for name in ("pytorch_lora_weights.safetensors", "demo_kohya.safetensors"):
        assert files[name] == (run_dir / "output" / name).read_bytes()
    assert sorted(n for n in files if n.startswith("samples/")) == ["samples/step-000004-p00.png",
                                                                     "samples/step-000004-p01.png"]
    card = files["README.md"].decode()
    # The demo's base is shipped, not on the Hub: no base_model (it must be a repo id), its licence, no local path.
    assert "base_model" not in hub.card_metadata and hub.card_metadata["license"] == "apache-2.0"
    assert "imagetune's demo base `tiny-sd`" in card and str(REPO) not in card
    assert {"lora", "sd", "imagetune"} <= set(hub.card_metadata["tags"])
    assert "![sample 1](samples/step-000004-p01.png)" in card
    assert "| steps | 4 |" in card and "| precision | fp32 |" in card
    assert set(hub.authorizations) == {f"Bearer {TOKEN}"}  # the token was used...
    assert TOKEN.encode() not in _everything_written(run_dir, result)  # ...and written nowhere


@pytest.mark.slow
def test_a_refused_upload_is_a_warning_and_the_run_stays_done(tmp_path):
    with FakeHub(refuse=403) as hub:
        result, run_dir = _train(tmp_path, hub, "train.steps=1", "sample.every=0", "sample.prompts=[]",
                                 "sample.concept={prompt: '', shows: ''}", "sample.control={prompt: '', shows: ''}",
                                 "output.push_to_hub=someone-else/their-repo")
    assert result.returncode == 0, result.stderr[-3000:]
    events = read_events(run_dir)
    assert events[-1]["type"] == "done" and "hub" not in events[-1]
    warning = next(e["message"] for e in events if e["type"] == "warning" and "push_to_hub" in e["message"])
    assert "someone-else/their-repo" in warning and "403" in warning and "output/" in warning
    assert (run_dir / "output" / "pytorch_lora_weights.safetensors").is_file()
    assert TOKEN.encode() not in _everything_written(run_dir, result)
    assert f"python launch.py --push-to-hub {run_dir}" in warning
    # Fixed (here: a Hub that accepts it), the done run is uploaded from its folder, to the repo named now: the
    # Runs tab's Upload button, which runs `launch.py --push-to-hub RUN REPO` as a process of its own.
    from app.hub_uploads import HubUploads

    uploads = HubUploads()
    with FakeHub() as hub, pytest.MonkeyPatch.context() as env:
        for name, value in (("HF_ENDPOINT", hub.url), ("HF_TOKEN", TOKEN), ("HF_HUB_OFFLINE", "0")):
            env.setenv(name, value)
        assert uploads.start(run_dir, "me/mine", exposed=False).wait(timeout=120) == 0, \
            (run_dir / "train.log").read_text()[-3000:]
    assert uploads.status(run_dir) == ("ok", f"uploaded: {hub.url}/me/mine")
    assert hub.repos["me/mine"]["files"]["pytorch_lora_weights.safetensors"] == \
        (run_dir / "output" / "pytorch_lora_weights.safetensors").read_bytes()
    assert "| steps | 1 |" in hub.repos["me/mine"]["files"]["README.md"].decode()


def test_only_a_done_run_is_pushed_after_the_fact(tmp_path):
    (tmp_path / "running").mkdir()
    (tmp_path / "running" / "config.yaml").write_text("name: running\n")
    (tmp_path / "running" / "events.jsonl").write_text('{"type": "plan", "time": 1}\n')
    for folder in ("running", "nowhere"):
        result = subprocess.run([sys.executable, str(REPO / "launch.py"), "--push-to-hub", str(tmp_path / folder),
                                 "me/x"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "is not a done run" in result.stderr and "Traceback" not in result.stderr


def test_the_ui_uploads_only_a_done_run_to_a_valid_repo_and_never_from_an_exposed_ui(monkeypatch, tmp_path):
    from app.hub_uploads import EXPOSED, HubUploads
    from trainer.errors import UserError

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    run = tmp_path / "demo"
    run.mkdir()
    (run / "config.yaml").write_text("name: demo\nmodel: {family: sd}\n")
    (run / "events.jsonl").write_text('{"type": "plan", "time": 1}\n')
    uploads = HubUploads()
    with pytest.raises(UserError, match="has not finished"):
        uploads.start(run, "me/x", exposed=False)
    with (run / "events.jsonl").open("a") as events:
        events.write('{"type": "done", "time": 2, "step": 4, "outputs": []}\n')
    with pytest.raises(UserError) as refused:
        uploads.start(run, "me/x", exposed=True)
    assert str(refused.value) == EXPOSED and "python launch.py --push-to-hub" in EXPOSED
    with pytest.raises(UserError, match="'no-namespace' is not a Hub repo id"):
        uploads.start(run, "no-namespace", exposed=False)
    assert uploads.status(run) is None  # nothing started


def test_a_bad_repo_id_a_missing_token_and_detection_are_refused_before_training(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for repo in ("no-namespace", "a/b/c", "me/has space", "me/..x"):
        with pytest.raises(ConfigError, match="output.push_to_hub: .* is not a Hub repo id"):
            load_config(None, [f"output.push_to_hub={repo}"], check_paths=False)
    with pytest.raises(ConfigError, match="detection runs are not uploaded"):
        load_config(None, ["model.family=detection", "model.path=fcos_resnet50_fpn", "output.push_to_hub=me/x"],
                    check_paths=False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "token"))  # nor a login file
    with pytest.raises(ConfigError, match="no Hugging Face token: set HF_TOKEN"):
        load_config(None, ["output.push_to_hub=me/x"], check_paths=False)


CARD_OF_A_HUB_BASE = """
import trainer.families  # the script's entry point fills the family registry
from trainer.core.config import load_config
from trainer.core.hub import base_licence, model_card
config = load_config(None, ["model.family=sdxl", "model.path=org/base-xl", "data.caption_prefix=ohwx,", "name=mine"],
                     check_paths=False)
print(base_licence("org/base-xl"), base_licence("org/missing"))
print(model_card(config, "me/mine", base_licence("org/base-xl"), [], 10, precision="bf16",
                 files=["mine_kohya.safetensors"]))
"""


def test_a_hub_base_gets_its_licence_from_its_card_and_is_the_cards_base_model():
    with FakeHub(licences={"org/base-xl": "openrail++"}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(REPO)}
        result = subprocess.run([sys.executable, "-c", CARD_OF_A_HUB_BASE], env=env, capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 0, result.stderr
    first, card = result.stdout.split("\n", 1)
    assert first == "openrail++ other"  # a repo the Hub does not have: `other`, and the card still names it
    assert "base_model: org/base-xl\nlicense: openrail++" in card and 'instance_prompt: "ohwx"' in card
    assert 'from_pretrained("org/base-xl")' in card and "`mine_kohya.safetensors`" in card
    assert "| precision | bf16 |" in card
