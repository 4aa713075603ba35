"""The launcher and launch.py: run folders, torchrun commands, stop/kill/failure paths, resume, multi-node.

Live tests run tests/fake_worker.py under real torchrun (real processes, real gloo); the real worker is tested
elsewhere. Each launch costs a few seconds of torch imports, so the live tests chain what they can.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer.core.config import load_config
from trainer.errors import ConfigError, UserError
from trainer.core.events import read_events
from trainer.core.hardware import Hardware
from trainer.core.launcher import build_command, build_env, prepare_run, start_run
from trainer.core.proctree import kill_tree
from trainer.core.resume import prepare_resume
from trainer.core.plan import Plan
from trainer.core.checkpoint import latest_checkpoint
from trainer.core.failures import parse_root_cause
from trainer.core.runfolder import create_run_dir

REPO = Path(__file__).resolve().parents[1]
CPU2 = Hardware(cpu_count=2)
FAKE = "tests.fake_worker"


@pytest.fixture
def paths(tmp_path):
    from PIL import Image

    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "data" / "red.png")  # one usable image passes the check
    (tmp_path / "data" / "red.txt").write_text("a red square")
    return tmp_path


def make_config(tmp: Path, overrides=(), **raw):
    preset = {"name": "t", "devices": "cpu:2", "model": {"path": str(tmp / "model")},
              "data": {"path": str(tmp / "data")}}
    preset.update(raw)
    return load_config(preset, list(overrides))


@pytest.fixture
def procs():
    """RunProcesses started by a test; whatever is still running at the end is killed."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            kill_tree(proc.pid, grace_s=2, process=proc.process)


def types(run_dir) -> list[str]:
    return [e["type"] for e in read_events(run_dir)]


def wait_for_event(run_dir, kind, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in read_events(run_dir):
            if event["type"] == kind:
                return event
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {run_dir} after {timeout}s: {types(run_dir)}")


def launch(*args, cwd, **kwargs):
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------------------
# Run folders


def test_run_name_is_never_overwritten(paths):
    config = make_config(paths)
    first, _ = prepare_run(config, paths / "runs", CPU2)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    second, _ = prepare_run(config, paths / "runs", CPU2)
    assert (first.name, second.name) == ("t", "t-2")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before


def test_racing_launches_get_different_folders(tmp_path):
    got, barrier = [], threading.Barrier(8)

    def claim():
        barrier.wait()
        got.append(create_run_dir(tmp_path, "same"))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8


def test_prepare_writes_resolved_config_plan_and_plan_event_first(paths, monkeypatch):
    monkeypatch.chdir(paths)
    config = make_config(paths, model={"path": "model"}, data={"path": "data"})  # relative to the cwd
    run_dir, plan = prepare_run(config, "runs", CPU2)
    events = read_events(run_dir)
    assert [e["type"] for e in events] == ["plan"]
    assert events[0]["world_size"] == 2 and events[0]["line"] == plan.line()
    assert Plan.from_event(json.loads((run_dir / "plan.json").read_text())) == plan
    saved = load_config(run_dir / "config.yaml")
    assert saved.model.path == str(paths / "model") and saved.data.path == str(paths / "data")


def test_demo_paths_are_resolved_under_the_runs_folder(paths, monkeypatch):
    calls = []

    def fake_assets(root, names=None):
        calls.append(Path(root))
        return {"tiny-sd": paths / "model", "demo-data": paths / "data"}

    monkeypatch.setattr("trainer.core.assets.demo_assets", fake_assets)  # the real one builds in a child process
    config = make_config(paths, model={"path": "demo://tiny-sd"}, data={"path": "demo://demo-data"})
    run_dir, _ = prepare_run(config, paths / "runs", CPU2)
    saved = load_config(run_dir / "config.yaml")
    assert calls == [(paths / "runs" / ".demo").resolve()]
    assert (saved.model.path, saved.data.path) == (str(paths / "model"), str(paths / "data"))


def test_bad_plan_or_name_creates_nothing(paths):
    with pytest.raises(ConfigError, match="GPUs"):
        prepare_run(make_config(paths, devices=2), paths / "runs", CPU2)
    with pytest.raises(UserError, match="folder name"):
        prepare_run(make_config(paths, name="../escape"), paths / "runs", CPU2)
    assert not (paths / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# Command and environment


def test_command_single_and_multi_node(paths):
    config = make_config(paths, devices="cpu:2")
    plan = Plan("cpu", (), 1, 2, 1, 2, 4, "fp32", "sdpa", 10)
    cmd = build_command(paths / "r", plan, config, resume=paths / "r/checkpoints/step-000010")
    assert cmd[:3] == [sys.executable, "-m", "trainer.engine.torchrun"] and "--standalone" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[-5:-1] == ["--module", "trainer.engine.worker", str(paths / "r"), "--resume"]
    assert cmd[-1] == str(paths / "r/checkpoints/step-000010")
    multi = make_config(paths, distributed={"nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 1234})
    cmd = build_command(paths / "r", Plan("cpu", (), 2, 2, 1, 1, 4, "fp32", "sdpa", 10), multi)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--rdzv-backend"] == "static" and flags["--node-rank"] == "1" and flags["--nnodes"] == "2"
    assert (flags["--master-addr"], flags["--master-port"]) == ("10.0.0.1", "1234")
    # One process on one node: the worker itself, without torchrun's agent (two nodes of one process keep it)
    one = Plan("cpu", (), 1, 1, 1, 4, 4, "fp32", "sdpa", 10)
    cmd = build_command(paths / "r", one, make_config(paths, devices="cpu:1"), resume=paths / "r/checkpoints/step-000010")
    assert cmd == [sys.executable, "-u", "-m", "trainer.engine.worker", str(paths / "r"),
                   "--resume", str(paths / "r/checkpoints/step-000010")]
    two_nodes = make_config(paths, distributed={"nodes": 2, "node_rank": 0, "master_addr": "10.0.0.1", "master_port": 1234})
    cmd = build_command(paths / "r", Plan("cpu", (), 2, 1, 1, 2, 4, "fp32", "sdpa", 10), two_nodes)
    assert cmd[:3] == [sys.executable, "-m", "trainer.engine.torchrun"]


def test_environment():
    cpu = Plan("cpu", (), 1, 2, 1, 2, 4, "fp32", "sdpa", 10)
    env = build_env(cpu, {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONUNBUFFERED"] == "1"
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["PYTHONPATH"].startswith(str(REPO))
    assert build_env(cpu, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    # A CPU run's OpenMP threads sleep while they wait (they spun, taking shared cores): unless the user says
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert build_env(cpu, {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    gpu = Plan("cuda", (1, 2), 1, 2, 1, 2, 4, "bf16", "sdpa", 10)
    assert build_env(gpu, {})["CUDA_VISIBLE_DEVICES"] == "1,2" and "OMP_WAIT_POLICY" not in build_env(gpu, {})
    # ids count the GPUs this process sees: translate through an existing CUDA_VISIBLE_DEVICES
    assert build_env(gpu, {"CUDA_VISIBLE_DEVICES": "4,5,6"})["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert "RANK" not in env and "MASTER_PORT" not in env  # torchrun's agent sets them for its workers
    # One process without torchrun: the worker gets the environment torchrun's agent would give it, and hosts
    # the store itself on a port the system picks
    one = build_env(Plan("cuda", (1,), 1, 1, 1, 4, 4, "bf16", "sdpa", 10), {"TORCHELASTIC_ERROR_FILE": "/x"}, "r1")
    assert {k: one[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
        "MASTER_PORT": "0", "TORCHELASTIC_RUN_ID": "r1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert one["CUDA_VISIBLE_DEVICES"] == "1" and "TORCHELASTIC_ERROR_FILE" not in one


def test_parse_torchrun_root_cause():
    text = """Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)\n----\n
Root Cause (first observed failure):\n[0]:\n  time      : x\n  host      : h\n  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 2)  (SIGKILL)\n======"""
    cause = parse_root_cause(text)
    assert (cause.rank, cause.local_rank, cause.exitcode) == (3, 1, -9)
    assert parse_root_cause("no summary here") is None


def summary(root: tuple[int, int], *others: tuple[int, int]) -> str:
    """torchrun's failure summary (its own template) for (rank, exitcode) pairs."""
    def entry(i, rank, code):
        return (f"[{i}]:\n  time      : 2026-12-02_01:00:00\n  host      : h\n  rank      : {rank} (local_rank: {rank})\n"
                f"  exitcode  : {code} (pid: {100 + rank})\n  error_file: <N/A>\n  traceback : x")
    listed = "\n".join(entry(i + 1, *o) for i, o in enumerate(others)) or "  <NO_OTHER_FAILURES>"
    return (f"====\nworker.py FAILED\n----\nFailures:\n{listed}\n----\n"
            f"Root Cause (first observed failure):\n{entry(0, *root)}\n====")


def test_a_rank_killed_by_a_signal_is_the_root_cause_even_when_torchrun_ties_it_with_its_victim():
    # torchrun's timestamps are whole seconds: a SIGKILLed rank 1 and rank 0 failing on the closed connection in
    # the same second tie, and torchrun names rank 0. The killed rank is the cause.
    cause = parse_root_cause(summary((0, 1), (1, -9)))
    assert (cause.rank, cause.exitcode) == (1, -9)
    # A rank torchrun itself terminated (SIGTERM) is not a cause; nor is an error exit listed second.
    assert parse_root_cause(summary((0, 1), (1, -15))).rank == 0
    assert parse_root_cause(summary((2, -11), (0, -9))).rank == 2
    assert parse_root_cause(summary((1, 1))).rank == 1
    # Only the last summary counts (train.log keeps every launch's).
    assert parse_root_cause(summary((0, 1), (1, -9)) + "\n" + summary((3, 1))).rank == 3


# ----------------------------------------------------------------------------------------------------------------
# Resume (no processes)


def stopped_run(paths, steps=100):
    run_dir, _ = prepare_run(make_config(paths, train={"steps": steps}), paths / "runs", CPU2)
    ckpts = run_dir / "checkpoints"
    for name, complete in [("step-000010", True), ("step-000030", True), ("step-000040", False),
                           (".tmp-step-000050", True), ("step-oops", True)]:
        (ckpts / name).mkdir(parents=True)
        if complete:
            (ckpts / name / "COMPLETE").touch()
    (run_dir / "launcher.pid").write_text("999999999\n")  # a launcher long gone
    return run_dir


def test_resume_picks_the_newest_complete_checkpoint(paths):
    run_dir = stopped_run(paths)
    assert latest_checkpoint(run_dir).step == 30
    r = prepare_resume(run_dir, ["train.steps=200", "train.lr=5e-5"], CPU2)
    assert r.checkpoint.path == run_dir / "checkpoints" / "step-000030"
    assert r.changes == {"train.steps": [100, 200], "train.lr": [1e-4, 5e-5]} and r.plan.steps == 200


def test_resume_rejects_what_would_break_the_state(paths):
    run_dir = stopped_run(paths)
    for override, key in [("lora.rank=4", "lora.rank"), ("method=full", "method"), ("batch.total=8", "batch.total"),
                          ("seed=3", "seed"), (f"model.path={paths}", "model.path")]:
        with pytest.raises(UserError, match=f"Cannot change {key}"):
            prepare_resume(run_dir, [override], CPU2)
    with pytest.raises(UserError, match="nothing is left to train"):
        prepare_resume(run_dir, ["train.steps=30"], CPU2)
    with pytest.raises(UserError, match="split"):
        prepare_resume(run_dir, ["devices=cpu:3"], Hardware(cpu_count=3))  # batch 4 over 3 processes
    (run_dir / "launcher.pid").write_text(f"{os.getpid()}\n")
    with pytest.raises(UserError, match="still running"):
        prepare_resume(run_dir, [], CPU2)
    for c in (run_dir / "checkpoints").glob("step-0000[13]0"):
        (c / "COMPLETE").unlink()
    (run_dir / "launcher.pid").unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        prepare_resume(run_dir, [], CPU2)


# ----------------------------------------------------------------------------------------------------------------
# The command line


def write_preset(paths, **raw) -> Path:
    config = {"name": "cli", "devices": "cpu:2", "model": {"path": str(paths / "model")},
              "data": {"path": str(paths / "data")}, **raw}
    path = paths / "preset.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_dry_run_creates_nothing(paths):
    preset = write_preset(paths)
    before = sorted(p for p in paths.rglob("*"))
    result = launch("--preset", str(preset), "--dry-run", "train.lr=3e-4", cwd=paths)
    assert result.returncode == 0, result.stderr
    assert "lr: 0.0003" in result.stdout and "plan: 2 processes x" in result.stdout
    assert sorted(p for p in paths.rglob("*")) == before


@pytest.mark.parametrize("args, words", [
    (["--preset", "missing.yaml"], "does not exist"),
    (["--preset", "PRESET", "trian.lr=1"], "did you mean 'train.lr'"),
    (["--preset", "PRESET", "devices=cpu:4", "batch.total=2"], "batch.total"),
    (["--preset", "PRESET", "notakeyvalue"], "KEY=VALUE"),
    (["--resume", "nowhere"], "not a run folder"),
    (["--host", "0.0.0.0", "--auth", "nocolon"], "user:password"),
])
def test_user_mistakes_exit_2_without_traceback(paths, args, words):
    preset = write_preset(paths)
    result = launch(*[str(preset) if a == "PRESET" else a for a in args], cwd=paths)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr + result.stdout
    assert result.stderr.startswith("error: ")


def test_web_ui_missing_is_a_clear_message(monkeypatch, capsys):
    import launch as cli

    monkeypatch.setitem(sys.modules, "app", None)
    monkeypatch.setitem(sys.modules, "app.main", None)
    assert cli.main([]) == 2
    assert "web UI" in capsys.readouterr().err


@pytest.mark.slow
def test_headless_ctrl_c_stops_then_resume_reports_a_killed_rank(paths):
    """One scenario, three paths: Ctrl-C -> STOP -> `stopped`; --resume from that checkpoint; a rank SIGKILLed
    after the resume -> exactly one `failed` (after the `resumed`) naming rank 1 with its last log lines."""
    preset = write_preset(paths, train={"steps": 100000}, checkpoint={"every": 1000})
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), "--preset", str(preset), "--runs-dir", "runs",
                             "--worker-module", FAKE], cwd=paths, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run_dir = paths / "runs" / "cli"
    try:
        wait_for_event(run_dir, "progress")
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the STOP file, a checkpoint, then `stopped`
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "plan: 2 processes" in out and "stopped at step" in out and "launch.py --resume" in out
    events = read_events(run_dir)
    assert events[0]["type"] == "plan" and events[-1]["type"] == "stopped"
    stop_step = events[-1]["step"]
    assert (run_dir / "STOP").exists() and (run_dir / events[-1]["checkpoint"] / "COMPLETE").exists()
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "fake_ranks").glob("*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2  # two real processes

    crash = {**os.environ, "FAKE_WORKER_CRASH": f"1:{stop_step + 3}:kill"}
    result = launch("--resume", str(run_dir), "train.lr=5e-5", "--worker-module", FAKE, cwd=paths, env=crash)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"at step {stop_step}" in result.stdout and "failed: Rank 1" in result.stderr
    assert not (run_dir / "STOP").exists()
    events = read_events(run_dir)
    after = events[[e["type"] for e in events].index("resumed"):]
    assert after[0]["step"] == stop_step and after[0]["changes"] == {"train.lr": [1e-4, 5e-5]}
    assert [e["step"] for e in after if e["type"] == "progress"][0] == stop_step + 1
    final = after[-1]
    assert [e["type"] for e in after].count("failed") == 1 and final["type"] == "failed"
    assert final["rank"] == 1 and final["exitcode"] == -signal.SIGKILL and "SIGKILL" in final["reason"]
    assert f"crashing on purpose at step {stop_step + 3}" in final["reason"]  # the rank's own last log lines


# ----------------------------------------------------------------------------------------------------------------
# Live launcher


@pytest.mark.slow
def test_two_nodes_on_localhost(paths, procs):
    port = free_port()
    run_dirs = {}
    for node_rank in (1, 0):  # node 1 first: rank order must not depend on who joins first
        distributed = {"nodes": 2, "node_rank": node_rank, "master_port": port}
        config = make_config(paths, train={"steps": 10}, distributed=distributed)
        run_dir, plan = prepare_run(config, paths / f"node{node_rank}", CPU2)
        assert plan.world_size == 4
        run_dirs[node_rank] = run_dir
        procs.append(start_run(run_dir, plan, config, worker_module=FAKE))
    finals = [p.wait(timeout=120) for p in procs]
    assert [f["type"] for f in finals] == ["done", "done"], [read_events(d)[-1] for d in run_dirs.values()]
    for node_rank, run_dir in run_dirs.items():
        seen = [json.loads(p.read_text()) for p in sorted((run_dir / "fake_ranks").glob("*.json"))]
        assert [s["rank"] for s in seen] == [2 * node_rank, 2 * node_rank + 1]
        assert {s["world_size"] for s in seen} == {4} and {s["node_rank"] for s in seen} == {node_rank}
    assert types(run_dirs[0]).count("progress") == 10 and types(run_dirs[0])[-1] == "done"
    assert types(run_dirs[1]) == ["plan", "done"]  # rank 0's events go to node 0 only


@pytest.mark.slow
def test_kill_ends_the_whole_group_with_one_failed_event(paths, procs, monkeypatch):
    # Slow steps, so that the workers cannot finish a graceful stop on SIGTERM within the grace period (with
    # fast steps they do, and the run ends `stopped`: kill() is SIGTERM first, SIGKILL only for what is left).
    monkeypatch.setenv("FAKE_WORKER_STEP_S", "5")
    config = make_config(paths, train={"steps": 100000})
    run_dir, plan = prepare_run(config, paths / "runs", CPU2)
    procs.append(start_run(run_dir, plan, config, worker_module=FAKE))
    deadline = time.monotonic() + 60
    while len(list((run_dir / "fake_ranks").glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    procs[-1].kill(grace_s=1)
    final = procs[-1].wait(timeout=30)
    assert final["type"] == "failed" and "killed on request" in final["reason"]
    # torchrun puts each worker in its own session: they must die too, not live on and write `stopped` later
    workers = [json.loads(p.read_text())["pid"] for p in (run_dir / "fake_ranks").glob("*.json")]
    assert len(workers) == 2 and not any(running(pid) for pid in workers)
    assert types(run_dir) == ["plan", "failed"]  # and with every worker gone, nothing can write `stopped` later


@pytest.mark.slow
def test_a_one_process_run_is_its_worker_without_torchrun(paths, procs, monkeypatch):
    """One process: the launcher starts the worker itself (no torchrun agent in the tree), records the worker's
    pid as the run's process, and still ends a crash with a `failed` event naming the rank, its exit and its
    traceback; the run resumes from its checkpoint (the lock was released), and Kill through launcher.pid (the
    UI's way) ends it."""
    from trainer.core.launcher import kill_run
    from trainer.core.proctree import descendants
    from trainer.core.resume import resume_run

    monkeypatch.setenv("FAKE_WORKER_CRASH", "0:3:exit")  # rank 0 raises at step 3 (after step 2's checkpoint)
    config = make_config(paths, devices="cpu:1", train={"steps": 100000}, checkpoint={"every": 2})
    run_dir, plan = prepare_run(config, paths / "runs", CPU2)
    proc = start_run(run_dir, plan, config, worker_module=FAKE)
    procs.append(proc)
    # While it runs: launcher.pid is the process the launcher started, and it is the worker (no agent above it)
    wait_for_event(run_dir, "checkpoint")
    worker = json.loads((run_dir / "fake_ranks" / "0.json").read_text())
    assert worker["pid"] == proc.pid == int((run_dir / "launcher.pid").read_text().split()[0])
    assert (worker["rank"], worker["world_size"], worker["local_rank"], worker["node_rank"]) == (0, 1, 0, 0)
    final = proc.wait(timeout=60)
    log = (run_dir / "train.log").read_text()
    assert "torch.distributed.run" not in log and f"-m {FAKE} {run_dir}" in log
    assert not (run_dir / "logs").exists() and not (run_dir / "run.lock").exists()
    assert final["type"] == "failed" and (final["rank"], final["exitcode"], final["log"]) == (0, 1, "train.log")
    assert final["reason"].startswith("Rank 0 (local rank 0 on node 0) exited with code 1.")
    assert "crashing on purpose at step 3" in final["reason"]  # the rank's last lines, its traceback's end
    assert "RuntimeError: fake failure on rank 0 at step 3" in final["reason"]
    assert "$ " not in final["reason"]  # not the launcher's command line

    monkeypatch.setenv("FAKE_WORKER_STEP_S", "5")  # a stop cannot finish within the kill's grace period
    monkeypatch.delenv("FAKE_WORKER_CRASH")
    resumed = resume_run(run_dir, hw=CPU2, worker_module=FAKE)
    procs.append(resumed)
    assert f"--resume {run_dir / 'checkpoints' / 'step-000002'}" in (run_dir / "train.log").read_text()
    deadline = time.monotonic() + 60
    while json.loads((run_dir / "fake_ranks" / "0.json").read_text())["pid"] != resumed.pid:
        assert time.monotonic() < deadline, "the resumed worker did not start"
        time.sleep(0.05)
    assert resumed.poll() is None and not descendants(resumed.pid)  # the worker, not an agent with a child
    assert kill_run(run_dir, grace_s=1)  # through launcher.pid, like a UI that did not start the run
    final = resumed.wait(timeout=30)
    assert not running(resumed.pid)
    # Both this launcher and kill_run see the worker end: one ending, and it says Kill ended the run
    assert final["type"] == "failed" and final["killed"] is True and "killed on request" in final["reason"]
    assert [e["type"] for e in read_events(run_dir)].count("failed") == 2  # one per launch


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_dataset_without_usable_images_is_refused_before_anything_starts(tmp_path, demo_assets):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "--preset", str(REPO / "presets" / "demo.yaml"),
         "--runs-dir", str(runs), f"model.path={demo_assets['tiny-sd']}", f"data.path={empty}", "devices=cpu:1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert str(empty) in result.stderr and "data.path" in result.stderr
    assert not (runs / "demo").exists()
