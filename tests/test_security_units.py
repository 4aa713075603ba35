"""Issue 10, "the exposed web UI is safe to put on the internet": one fast test per defence; the attacker against
a real UI (started on 127.0.0.2, which the UI treats as exposed) is tests/test_security.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.guard import LoginThrottle, OriginPolicy, lax_cookie, normalize_origin
from app.security import Workspace, check_exposure
from tests.security_helpers import MALFORMED, image_folder, lora_config, malformed_runs, stopped_run
from trainer.core.config import load_config
from trainer.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# 1. Config values are data, never code


@pytest.mark.parametrize("preset, overrides, key", [
    ({"name": "${oc.env:SECRET_TOKEN}"}, [], "name"),
    ({}, ["data.path=${oc.env:NOPE,/usr/share/pixmaps}"], "data.path"),
    ({"sample": {"prompts": ["a cat", "${name}"]}}, [], "sample.prompts"),
    ({}, ["train.lr=${train.steps}"], "train.lr"),
])
def test_interpolation_is_refused_not_resolved(monkeypatch, preset, overrides, key):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2-secret")
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides, check_paths=False)
    assert [p.split(":", 1)[0] for p in info.value.problems] == [key]
    assert "hunter2-secret" not in str(info.value) and "/usr/share/pixmaps'" not in str(info.value).split("'")[0]


def test_a_run_config_with_interpolation_is_refused_on_resume(tmp_path):
    run = stopped_run(tmp_path / "runs", image_folder(tmp_path / "data"))
    text = (run / "config.yaml").read_text().replace("name: victim", "name: ${oc.env:HOME}")
    (run / "config.yaml").write_text(text)
    from trainer.core.resume import prepare_resume

    with pytest.raises(ConfigError, match=r"name: '\$\{oc.env:HOME\}' contains"):
        prepare_resume(run)


@pytest.mark.parametrize("value", ["${oc.env:NOPE_UNSET}", "${oc.env:NOPE,/usr/share}", "${no.such.key}"])
def test_cli_refuses_interpolation_with_exit_2_and_no_traceback(tmp_path, value):
    result = subprocess.run([sys.executable, "launch.py", "--preset", "demo", "--dry-run", f"name={value}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "contains '${'" in result.stderr and "name:" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# 2. Confinement checks the built config, every path key, and what dataset descriptors point to


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "ws"
    image_folder(root / "data")
    image_folder(tmp_path / "outside")
    (root / "escape").symlink_to(tmp_path / "outside")
    return Workspace(root, confined=True)


def detection(data: Path, **detection_keys):
    return load_config({"model": {"family": "detection", "path": "fcos_tiny"}, "method": "full",
                        "data": {"path": str(data)},
                        "detection": {"weights": "none", **detection_keys}, "devices": "cpu:1"}, check_paths=False)


def test_every_path_key_of_the_built_config_is_confined(workspace, tmp_path):
    ws, outside = workspace, str(tmp_path / "outside")
    assert ws.built_problems(lora_config(ws.root / "data")) == []
    for key, config in [
        ("data.path", lora_config(ws.root / "escape")),  # a symlink out of the workspace
        ("prior.class_path", lora_config(ws.root / "data", **{"prior.class_path": outside})),
        ("model.path", lora_config(ws.root / "data", **{"model.path": outside})),
        ("flow.training_adapter", lora_config(ws.root / "data", **{"model.family": "flux",
                                                                  "flow.training_adapter": outside + "/a.safetensors"})),
        ("detection.weights", detection(ws.root / "data", weights=outside + "/w.safetensors")),
        ("detection.images", detection(ws.root / "data", images=outside)),
        ("detection.val_path", detection(ws.root / "data", val_path=outside + "/val.json")),
    ]:
        problems = ws.built_problems(config)
        assert problems and problems[0].startswith(f"{key}:") and "outside the workspace" in problems[0], key
        with pytest.raises(UserError, match="outside the workspace"):
            ws.approve(config)
    assert ws.built_problems(detection(ws.root / "data")) == []  # weights: none is not a path
    assert Workspace(ws.root, confined=False).built_problems(lora_config(ws.root / "escape")) == []


def test_dataset_descriptors_may_only_point_inside_the_workspace(workspace, tmp_path):
    ws = workspace
    yolo = ws.root / "yolo"
    yolo.mkdir()
    (yolo / "data.yaml").write_text(f"train: {tmp_path / 'outside'}\nnames: [a]\n")
    problems = ws.built_problems(detection(yolo / "data.yaml"))
    assert problems and "data.path (data.yaml) train" in problems[0] and "outside the workspace" in problems[0]
    (ws.root / "list.txt").write_text(f"{tmp_path / 'outside' / 'img0.png'}\n")
    (yolo / "data.yaml").write_text(f"path: {ws.root}\ntrain: list.txt\nval: data\nnames: [a]\n")
    assert "list.txt" in ws.built_problems(detection(yolo))[0]
    (ws.root / "coco.json").write_text('{"images": [{"id": 1, "file_name": "../../outside/img0.png"}]}')
    assert "file_name" in ws.built_problems(detection(ws.root / "coco.json", images=str(ws.root / "data")))[0]
    (ws.root / "coco.json").write_text('{"images": [{"id": 1, "file_name": "img0.png"}]}')
    assert ws.built_problems(detection(ws.root / "coco.json", images=str(ws.root / "data"))) == []


def test_saved_presets_keep_schema_keys_only_and_refuse_escapes(workspace, tmp_path):
    from app import forms
    from app.presets import Presets

    presets = Presets(workspace.root / "presets")
    values = forms.from_yaml(f"train: {tmp_path / 'outside'}\nval: {tmp_path / 'outside'}\nnames: [a]\n"
                             "sample: {steps: 3}\n")
    presets.save("data", values, workspace)
    text = (workspace.root / "presets" / "data.yaml").read_text()
    assert "outside" not in text and "names" not in text and "steps: 3" in text
    for bad in ({**values, "data.path": str(tmp_path / "outside")}, {**values, "name": "${oc.env:HOME}"}):
        with pytest.raises(UserError, match="Not saved"):
            presets.save("bad", bad, workspace)
    assert not (workspace.root / "presets" / "bad.yaml").exists()


# ----------------------------------------------------------------------------------------------------------------
# 3. No multi-node from an exposed UI


def test_multi_node_and_remote_master_are_refused_when_exposed(workspace):
    config = lora_config(workspace.root / "data", **{"distributed.nodes": 2, "distributed.master_addr": "10.9.8.7"})
    problems = workspace.built_problems(config)
    assert [p.split(":")[0] for p in problems] == ["distributed.nodes", "distributed.master_addr"]
    from app.checks import check_values
    from app.forms import values_from_preset
    from trainer.core.hardware import Hardware

    values = {**values_from_preset({}), "model.path": str(workspace.root / "model"),
              "data.path": str(workspace.root / "data"),
              "devices": "cpu:1", "distributed.master_addr": "evil.example"}
    check = check_values(values, Hardware(cpu_count=2), workspace)
    assert not check.ok and any("master_addr" in p for p in check.other_errors + list(check.field_errors))


def test_uploads_with_this_machines_tokens_are_refused_when_exposed(workspace, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_owner")
    config = lora_config(workspace.root / "data", **{"output.push_to_hub": "owner/public-model",
                                                    "logging.wandb": "owner/project", "logging.tensorboard": True})
    problems = workspace.built_problems(config)
    assert [p.split(":")[0] for p in problems] == ["output.push_to_hub", "logging.wandb"]


def test_the_engine_exchanges_no_pickled_objects_between_ranks():
    found = subprocess.run(["grep", "-rnE", "all_gather_object|broadcast_object_list|gather_object|scatter_object",
                            "trainer/"], cwd=REPO, capture_output=True, text=True).stdout
    assert found == "", found


# ----------------------------------------------------------------------------------------------------------------
# 4. Cross-origin and DNS-rebinding requests


def test_only_the_uis_own_origin_and_listed_ones_are_allowed():
    policy = OriginPolicy.build("0.0.0.0", ["https://Abc-7860.proxy.runpod.net/"], environ={})
    assert policy.origin_problem(None, "10.0.0.5:7860") is None
    assert policy.origin_problem("http://10.0.0.5:7860", "10.0.0.5:7860") is None
    assert policy.origin_problem("https://abc-7860.proxy.runpod.net", "internal:7860") is None
    assert policy.origin_problem("https://pod.example", "pod.example") is None  # behind a TLS proxy
    for origin in ("https://evil.example", "null", "http://10.0.0.5:7861", "http://10.0.0.5.evil.example:7860"):
        assert policy.origin_problem(origin, "10.0.0.5:7860"), origin
    assert policy.host_problem("rebind.attacker.example") is None  # exposed: the Host is whatever proxies say
    env = OriginPolicy.build("0.0.0.0", [], environ={"IMAGETUNE_ALLOWED_ORIGINS": "https://a.example, http://b:81"})
    assert env.allowed == {"https://a.example", "http://b:81"}
    with pytest.raises(UserError, match="not an origin"):
        OriginPolicy.build("0.0.0.0", ["evil.example"], environ={})
    assert normalize_origin("HTTP://LocalHost:80") == "http://localhost"


def test_on_loopback_the_host_must_name_this_machine():
    for bind in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        policy = OriginPolicy.build(bind, [], environ={})
        assert policy.host_problem("rebind.attacker.example:7860"), bind
        assert policy.host_problem("localhost:7860") is None and policy.host_problem("127.0.0.1") is None
    assert OriginPolicy.build("127.0.0.2", [], environ={}).host_problem("127.0.0.2:7860") is None


def test_the_login_cookie_is_samesite_lax():
    assert lax_cookie(b"t=1; HttpOnly; Path=/; SameSite=none; Secure") == b"t=1; HttpOnly; Path=/; Secure; SameSite=Lax"
    assert lax_cookie(b"t=1; HttpOnly") == b"t=1; HttpOnly; SameSite=Lax"


# ----------------------------------------------------------------------------------------------------------------
# 5. Passwords: long enough when exposed; failed logins back off


def test_short_passwords_are_refused_when_exposed():
    with pytest.raises(UserError, match="at least 12"):
        check_exposure("0.0.0.0", False, ("admin", "password1"), False)
    check_exposure("0.0.0.0", False, ("admin", "a" * 12), False)
    check_exposure("0.0.0.0", False, ("admin", "short"), True)  # --insecure
    check_exposure("127.0.0.1", False, ("admin", "short"), False)  # this machine only


def test_failed_logins_back_off_exponentially_per_address():
    now = [1000.0]
    throttle = LoginThrottle(clock=lambda: now[0], base=1.0, cap=8.0)
    assert throttle.wait_s("a") == 0
    assert [throttle.failed("a") for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert throttle.wait_s("a") == 8.0 and throttle.wait_s("b") == 0  # per address
    now[0] += 7.5
    assert throttle.wait_s("a") == 0.5
    now[0] += 0.5
    assert throttle.wait_s("a") == 0
    throttle.succeeded("a")
    assert throttle.failed("a") == 1.0  # a success starts the count again


def test_launch_reads_the_login_from_the_environment(tmp_path):
    env = {**os.environ, "IMAGETUNE_AUTH": "admin:short"}
    result = subprocess.run([sys.executable, "launch.py", "--host", "0.0.0.0", "--runs-dir", str(tmp_path / "r")],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "at least 12" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# 6. Runs cannot collide; a stale PID is not a live run


def test_one_launch_at_a_time_owns_a_run_folder(tmp_path):
    from trainer.core.runlock import RunLock

    lock = RunLock(tmp_path).acquire()
    with pytest.raises(UserError, match="already being started or trained"):
        RunLock(tmp_path).acquire()  # a second Resume click, in this process or another UI
    lock.release()
    with RunLock(tmp_path):
        assert (tmp_path / "run.lock").read_text().split()[0] == str(os.getpid())
    assert not (tmp_path / "run.lock").exists()


def test_a_stale_lock_is_taken_over(tmp_path):
    from trainer.core.runlock import RunLock, start_time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(f"{dead.pid} 123\n")
    RunLock(tmp_path).acquire().release()
    (tmp_path / "run.lock").write_text(f"{os.getpid()} {start_time(os.getpid()) + 1}\n")  # PID reused since
    RunLock(tmp_path).acquire().release()


def test_resume_takes_the_run_lock(tmp_path):
    from trainer.core.resume import resume_run
    from trainer.core.runlock import RunLock

    run = stopped_run(tmp_path / "runs", image_folder(tmp_path / "data"))
    with RunLock(run):
        with pytest.raises(UserError, match="already being started or trained"):
            resume_run(run, ["train.steps=8"])
    refused = []
    with pytest.raises(UserError, match="no"):
        resume_run(run, ["train.steps=8"], approve=lambda c: refused.append(c) or (_ for _ in ()).throw(UserError("no")))
    assert refused and not (run / "run.lock").exists() and "steps: 4" in (run / "config.yaml").read_text()


def test_start_run_records_the_pid_with_its_start_time(tmp_path, monkeypatch):
    from trainer.core import launcher, runlock

    me = os.getpid()
    # A stand-in Popen that has already exited (poll): the stall watch's thread then ends at its first look.
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: type("P", (), {"pid": me, "poll": lambda s: 0})())
    config = lora_config(image_folder(tmp_path / "data"))
    launcher.start_run(tmp_path, launcher.plan_for(config), config)
    assert (tmp_path / "launcher.pid").read_text() == f"{me} {runlock.start_time(me)}\n"
    assert (tmp_path / "run.lock").read_text() == f"{me} {runlock.start_time(me)}\n"  # held while it runs
    launcher.release_lock(tmp_path, me)
    assert not (tmp_path / "run.lock").exists()


def test_a_reused_pid_is_neither_running_nor_signalled(tmp_path, monkeypatch):
    from app.runs import read_run
    from trainer.core import launcher, runlock

    me = os.getpid()
    run = stopped_run(tmp_path, tmp_path)
    (run / "events.jsonl").write_text('{"type": "plan", "time": 1, "steps": 4}\n')
    (run / "launcher.pid").write_text(f"{me} {runlock.start_time(me) + 5}\n")  # the PID belongs to another process now
    signalled = []
    monkeypatch.setattr(launcher, "kill_tree", lambda pid, grace: signalled.append(pid))
    assert read_run(run).status == "unknown" and runlock.recorded_pid(run / "launcher.pid") is None
    assert launcher.kill_run(run) is False and signalled == []
    (run / "launcher.pid").write_text(f"{me}\n")  # an old run folder: the PID only, still read
    assert read_run(run).status == "running" and launcher.kill_run(run) is True and signalled == [me]

    def denied(pid, sig):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "kill", denied)  # a run of another user (root in a container): alive, not dead
    assert read_run(run).status == "running" and runlock.pid_alive(1)


# ----------------------------------------------------------------------------------------------------------------
# 7. One malformed run folder never breaks the Runs page


def test_each_malformed_run_is_shown_unreadable_on_its_own_row(tmp_path):
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs
    from app.runs import EventCache, list_runs, run_rows
    from trainer.core.hardware import Hardware

    names = malformed_runs(tmp_path)
    stopped_run(tmp_path, tmp_path, "good")
    rows = {r[0]: r for r in run_rows(list_runs(tmp_path, EventCache()))}
    assert rows["good"][3] == "stopped"
    for name in names:
        assert rows[name][3].startswith("unreadable: "), (name, rows[name])
    ctx = type("Ctx", (), {"jobs": Jobs(tmp_path, HardwareCache(hw=Hardware(cpu_count=1)))})()
    for name in [*MALFORMED, "good"]:
        ui_runs.render(ui_runs.snapshot(ctx, name), {})  # the selected run renders too


# ----------------------------------------------------------------------------------------------------------------
# 8. Smaller holes


def test_names_must_match_whole():
    from app.presets import Presets
    from trainer.core.runfolder import check_run_name

    for name in ("evil\n", "ok\n../x", "a b"):
        with pytest.raises(UserError):
            check_run_name(name)
        with pytest.raises(UserError):
            Presets(Path("/nonexistent")).path(f"user/{name}")
    check_run_name("my-run.2")


def test_the_runs_folder_must_be_a_folder_of_its_own(tmp_path):
    from app.main import check_runs_dir

    for bad in ("/", str(Path.home()), str(tmp_path)):
        with pytest.raises(UserError, match="folder of its own"):
            check_runs_dir(bad, tmp_path)
    check_runs_dir(tmp_path / "runs", tmp_path)


def test_a_failed_prepare_removes_its_half_made_folder(tmp_path, monkeypatch):
    from trainer.core import launcher

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(launcher, "write_atomic", disk_full)
    with pytest.raises(UserError, match="No space left on device.*Free some space"):
        launcher.prepare_run(lora_config(image_folder(tmp_path / "data")), tmp_path / "runs")
    assert list((tmp_path / "runs").iterdir()) == []


def _exchange(rank: int, init: str, out: str) -> None:
    import json as _json

    import torch
    import torch.distributed as dist

    from trainer.families.components.collectives import broadcast_json, broadcast_tensors
    from trainer.families.detection.eval import gather

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    metrics = broadcast_json({"map": 0.5, "per_class": {"a": None}} if rank == 0 else None, src=0)
    tensors = broadcast_tensors({"x": torch.arange(3.0)} if rank == 1 else None, src=1)
    items = [(rank * 10 + i, {"boxes": torch.ones(i, 4) * rank}, {"labels": torch.tensor([rank, i])})
             for i in range(rank + 1)]  # ranks hold different counts
    gathered = gather(items, 2)
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(_json.dumps({
        "metrics": metrics, "x": tensors["x"].tolist(),
        "items": [(i, p["boxes"].shape[0], t["labels"].tolist()) for i, p, t in gathered]}))


@pytest.mark.slow
def test_ranks_exchange_tensors_and_json_not_pickles(tmp_path):
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_exchange, args=(f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["metrics"] == {"map": 0.5, "per_class": {"a": None}} and got["x"] == [0.0, 1.0, 2.0]
        assert got["items"] == [[0, 0, [0, 0]], [10, 0, [1, 0]], [11, 1, [1, 1]]]


# ----------------------------------------------------------------------------------------------------------------
# Issue 29: paths that are not model keys, links inside datasets, numbers, the client behind a proxy


def test_only_model_keys_may_be_hub_ids_and_every_other_path_is_written_absolute(tmp_path, monkeypatch):
    from trainer.core.assets import resolve_paths
    from trainer.core.config.validate import hub_id_at

    monkeypatch.chdir(tmp_path)
    assert hub_id_at("model.path", "org/name") and not hub_id_at("prior.class_path", "org/name")
    (tmp_path / "link").symlink_to(tmp_path)
    assert not hub_id_at("model.path", "link/new")  # its first part is a folder here: a path, not a hub id
    config = lora_config(image_folder(tmp_path / "data"), **{"prior.enabled": True, "prior.class_path": "class/dogs",
                                                             "prior.class_prompt": "a dog"})
    resolved = resolve_paths(config, tmp_path / "runs")
    assert resolved.prior.class_path == str(tmp_path / "class" / "dogs")  # was left relative as a "hub id"


def test_a_scan_confined_to_a_folder_skips_what_links_out(tmp_path, monkeypatch):
    from trainer.core.data.confine import CONFINE_ENV
    from trainer.core.data.scan import scan_dataset

    ws, outside = tmp_path / "ws", image_folder(tmp_path / "outside")
    image_folder(ws / "data" / "5_own")
    (ws / "data" / "10_linked").symlink_to(outside)
    (ws / "data" / "own.png").symlink_to(outside / "img0.png")
    (ws / "data" / "own.txt").write_text("its caption is in the workspace")
    assert scan_dataset(ws / "data").image_count == 5  # the command line follows links: a normal thing to have
    monkeypatch.setenv(CONFINE_ENV, str(ws))
    scan = scan_dataset(ws / "data")
    assert scan.image_count == 2 and set(scan.folders) == {"5_own"}
    assert any("10_linked/: links outside" in w for w in scan.warnings)
    assert any("own.png: links outside" in w for w in scan.warnings)


def test_the_client_behind_a_trusted_proxy_is_the_one_it_forwards():
    from app.guard import client_address, trusted_proxies

    proxies = trusted_proxies("10.0.0.0/8, 127.0.0.5")
    assert client_address("127.0.0.5", "203.0.113.9", proxies) == "203.0.113.9"
    # A client's own X-Forwarded-For entries come first; the proxy appends the address it saw, read from the right.
    assert client_address("127.0.0.5", "198.51.100.7, 203.0.113.9, 10.1.2.3", proxies) == "203.0.113.9"
    assert client_address("127.0.0.6", "198.51.100.7", proxies) == "127.0.0.6"  # not a proxy: header ignored
    assert client_address("127.0.0.5", None, proxies) == "127.0.0.5"
    with pytest.raises(UserError, match="IMAGETUNE_TRUSTED_PROXIES"):
        trusted_proxies("10.0.0.0/8, runpod")


def test_a_confined_yolo_scan_skips_images_and_labels_linking_out(tmp_path, monkeypatch):
    from PIL import Image

    from trainer.core.data.confine import CONFINE_ENV
    from trainer.families.detection.data import scan_detection

    ws, outside = tmp_path / "ws", tmp_path / "outside"
    for folder in (ws / "set" / "images" / "train", ws / "set" / "labels" / "train", outside):
        folder.mkdir(parents=True)
    for name, color in (("own", "gray"), ("labelled-outside", "blue")):
        Image.new("RGB", (64, 48), color).save(ws / "set" / "images" / "train" / f"{name}.jpg")
    Image.new("RGB", (64, 48), "red").save(outside / "theirs.jpg")
    (outside / "theirs.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (ws / "set" / "images" / "train" / "theirs.jpg").symlink_to(outside / "theirs.jpg")
    (ws / "set" / "labels" / "train" / "own.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (ws / "set" / "labels" / "train" / "labelled-outside.txt").symlink_to(outside / "theirs.txt")
    (ws / "set" / "data.yaml").write_text("path: .\ntrain: images/train\nnames: [thing]\n")
    scan = scan_detection(str(ws / "set" / "data.yaml"))
    assert len(scan.train + scan.val) == 3  # unconfined (the command line): links are followed
    monkeypatch.setenv(CONFINE_ENV, str(ws))
    scan = scan_detection(str(ws / "set" / "data.yaml"))
    assert [Path(r.path).stem for r in scan.train + scan.val] == ["own"] and scan.counts["outside"] == 2
