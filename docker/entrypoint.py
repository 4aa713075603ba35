#!/usr/bin/env python3
"""The container's entrypoint (run under tini, so signals reach the process it becomes).

    (no arguments)                  the web UI on 0.0.0.0:7860, login from the environment
    --preset PRESET [KEY=VALUE ...] a headless run into /workspace/runs (likewise --resume RUN, --help)
    --share, --port N, ...          other launch.py flags: the web UI with those flags added
    COMMAND [ARG ...]               anything else is run as it is (bash, nvidia-smi, python ...)
    --healthcheck                   Docker's HEALTHCHECK: is the web UI answering?

Environment (all optional; without a login the web UI makes one at start and prints it once in the log):
    IMAGETUNE_AUTH=user:password              the web UI's login (passed on to launch.py in its environment, never
                                              on its command line), or
    IMAGETUNE_USERNAME / IMAGETUNE_PASSWORD   the same in two variables (username defaults to `admin`)
    IMAGETUNE_INSECURE=1                      serve without a login (only on a network you trust)
    IMAGETUNE_PORT (7860), IMAGETUNE_HOST (0.0.0.0)
    IMAGETUNE_ALLOWED_ORIGINS                 origins besides the UI's own whose pages may call it (comma-separated);
                                              on RunPod (RUNPOD_POD_ID set) its proxy's origin is added
    IMAGETUNE_TRUSTED_PROXIES                 proxies whose X-Forwarded-For names the client for the login
                                              back-off (addresses or networks); on RunPod, its private networks
    IMAGETUNE_WORKSPACE (/workspace)          everything kept: runs/, datasets/, imagetune/ (IMAGETUNE_HOME, user
                                              presets in its presets/), hf-cache/ (HF_HOME)
    IMAGETUNE_UID[:GID] / IMAGETUNE_GID       whom to run as (default: the owner of the workspace, see below)
    IMAGETUNE_LAUNCH                          the command that runs launch.py (default: this interpreter and the
                                              launch.py beside docker/); the tests point it at a stub

Whom it runs as: started as root (the image's default), it creates the workspace folders, then runs everything
as the owner of the workspace folder (IMAGETUNE_UID overrides). The image's own /workspace (and so a fresh named
volume) belongs to the `imagetune` user (uid 1000); a bind-mounted folder belongs to whoever made it on the host,
so files stay theirs; RunPod's volume belongs to root, and so does everything its web terminal creates, so there it
stays root (a second user would be unable to write into runs started from the terminal, and the other way round).
Started as another user (docker run --user), it runs as that user.

Headless and other commands, it execs the command (tini's signals reach it directly: launch.py turns SIGTERM into
a graceful stop). The web UI it supervises instead, so that runs started from the UI also stop with a checkpoint
when the container stops (see `supervise`). The same logic serves `docker run` arguments, RunPod's start command and
`imagetune ...` typed in a terminal inside the container.
"""

from __future__ import annotations

import os
import pwd
import shlex
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKSPACE = "/workspace"
DEFAULT_PORT = "7860"
HEADLESS_FLAGS = ("--preset", "--resume", "--dry-run", "--help", "-h")
TRUE = ("1", "true", "yes", "on")
# The networks RunPod's HTTP proxy can reach a pod from (private and carrier-grade NAT ranges; its exact addresses
# are not published). Whoever connects from these ranges directly may name any client in X-Forwarded-For: the
# README's Security section says what that allows (a fresh login back-off, never a way past the password).
RUNPOD_PROXIES = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10"


class Refusal(Exception):
    """A configuration mistake: reported as one paragraph, exit status 2 (launch.py's convention)."""


@dataclass
class Plan:
    mode: str  # "ui" | "headless" | "command"
    argv: list[str]
    login: str | None = None  # the user name of the login, for the start message (never the password)
    env: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------------------
# Deciding the command line (pure functions of the arguments and the environment)
# --------------------------------------------------------------------------------------------------------------


def workspace_layout(env: dict[str, str]) -> dict[str, Path]:
    """The folders a user keeps; HF_HOME and IMAGETUNE_HOME default to places inside the workspace."""
    ws = Path(env.get("IMAGETUNE_WORKSPACE") or DEFAULT_WORKSPACE)
    home = Path(env.get("IMAGETUNE_HOME") or ws / "imagetune")
    return {
        "workspace": ws,
        "runs": ws / "runs",
        "datasets": ws / "datasets",
        "imagetune_home": home,
        "presets": home / "presets",
        "hf_home": Path(env.get("HF_HOME") or ws / "hf-cache"),
    }


def launch_command(env: dict[str, str]) -> list[str]:
    custom = env.get("IMAGETUNE_LAUNCH")
    return shlex.split(custom) if custom else [sys.executable, str(REPO / "launch.py")]


def mode_of(args: list[str]) -> str:
    if not args:
        return "ui"
    if not args[0].startswith("-"):
        return "command"
    if args[0] == "--healthcheck":
        return "healthcheck"
    names = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    return "headless" if names & set(HEADLESS_FLAGS) else "ui"


def login_from_env(env: dict[str, str]) -> str | None:
    """`user:password` from IMAGETUNE_AUTH or IMAGETUNE_USERNAME/IMAGETUNE_PASSWORD; None when neither is set."""
    auth = env.get("IMAGETUNE_AUTH", "")
    user, password = env.get("IMAGETUNE_USERNAME", ""), env.get("IMAGETUNE_PASSWORD", "")
    if auth and (user or password):
        raise Refusal("Set the login either as IMAGETUNE_AUTH=user:password or as IMAGETUNE_USERNAME and "
                      "IMAGETUNE_PASSWORD, not both.")
    if auth:
        name, sep, secret = auth.partition(":")
        if not (sep and name and secret):
            raise Refusal("IMAGETUNE_AUTH must look like user:password (both non-empty; the password may contain "
                          "':', the user name may not).")
        return auth
    if user and not password:
        raise Refusal("IMAGETUNE_USERNAME is set but IMAGETUNE_PASSWORD is not: set both (or IMAGETUNE_AUTH).")
    if password:
        user = user or "admin"
        if ":" in user:
            raise Refusal("IMAGETUNE_USERNAME may not contain ':'.")
        return f"{user}:{password}"
    return None


def _option(args: list[str], name: str) -> tuple[int, str, bool] | None:
    """Where the value of `--name VALUE` or `--name=VALUE` is: (index, value, joined); the last one wins."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = (i + 1, args[i + 1], False)
        elif arg.startswith(name + "="):
            found = (i, arg.split("=", 1)[1], True)
    return found


def resolve_names(args: list[str], layout: dict[str, Path]) -> list[str]:
    """`--preset NAME` finds the user's presets/NAME[.yaml]; `--resume NAME` finds runs/NAME.

    Only a value that is not an existing path (relative to the workspace, the current folder) is looked up, and
    only a match replaces it: shipped presets (presets/ of the source) are found by launch.py itself."""
    args = list(args)
    lookups = {
        "--preset": lambda v: [layout["presets"] / v, layout["presets"] / f"{v}.yaml"],
        "--resume": lambda v: [layout["runs"] / v],
    }
    for name, candidates in lookups.items():
        found = _option(args, name)
        if not found:
            continue
        index, value, joined = found
        if (layout["workspace"] / value).exists():
            continue
        match = next((c for c in candidates(value) if c.exists()), None)
        if match is not None:
            args[index] = f"{name}={match}" if joined else str(match)
    return args


def ui_port(args: list[str], env: dict[str, str]) -> str:
    found = _option(args, "--port")
    return found[1] if found else env.get("IMAGETUNE_PORT") or DEFAULT_PORT


def plan(args: list[str], env: dict[str, str]) -> Plan:
    mode = mode_of(args)
    layout = workspace_layout(env)
    extra_env = {"IMAGETUNE_WORKSPACE": str(layout["workspace"]), "IMAGETUNE_HOME": str(layout["imagetune_home"]),
                 "HF_HOME": str(layout["hf_home"])}
    if mode == "command":
        return Plan("command", list(args), env=extra_env)
    launch = launch_command(env)
    runs = ["--runs-dir", str(layout["runs"])]  # first, so that a --runs-dir among the arguments wins
    if mode == "headless":
        return Plan("headless", launch + runs + resolve_names(args, layout), env=extra_env)
    login = login_from_env(env)
    argv = launch + ["--host", env.get("IMAGETUNE_HOST") or "0.0.0.0", "--port", env.get("IMAGETUNE_PORT") or
                     DEFAULT_PORT] + runs
    has_flag = {a.split("=", 1)[0] for a in args}
    if login and "--auth" not in has_flag:
        # Through the environment, never as --auth: a command line is readable by every user of the machine (ps).
        extra_env["IMAGETUNE_AUTH"] = login
    elif not login and not has_flag & {"--auth", "--insecure"}:
        if env.get("IMAGETUNE_INSECURE", "").strip().lower() in TRUE:
            argv.append("--insecure")
        # else: launch.py makes a login for this start and prints it once (the container's log): an exposed UI
        # never runs open, and a template started without IMAGETUNE_AUTH still works.
    pod = env.get("RUNPOD_POD_ID", "").strip()
    if pod:  # RunPod's HTTP proxy serves the pod's port at this origin: its pages may call the UI
        proxy = f"https://{pod}-{ui_port(args, env)}.proxy.runpod.net"
        listed = [o for o in env.get("IMAGETUNE_ALLOWED_ORIGINS", "").split(",") if o.strip()]
        extra_env["IMAGETUNE_ALLOWED_ORIGINS"] = ",".join(listed + [proxy])
        # RunPod's proxy reaches the pod from its private network and appends each visitor's address to
        # X-Forwarded-For: believed from there, the login back-off is per visitor, not one for everybody.
        if not env.get("IMAGETUNE_TRUSTED_PROXIES", "").strip():
            extra_env["IMAGETUNE_TRUSTED_PROXIES"] = RUNPOD_PROXIES
    return Plan("ui", argv + list(args), login=(login or "").partition(":")[0] or None, env=extra_env)


# --------------------------------------------------------------------------------------------------------------
# Preparing the workspace, choosing the user, and exec
# --------------------------------------------------------------------------------------------------------------


def target_ids(env: dict[str, str], workspace: Path) -> tuple[int, int]:
    """uid, gid to run as when started as root: IMAGETUNE_UID[:GID] (or IMAGETUNE_GID), else the workspace's owner."""
    spec = env.get("IMAGETUNE_UID", "").strip()
    if not spec:
        info = workspace.stat()
        return info.st_uid, info.st_gid
    uid_text, _, gid_text = spec.partition(":")
    gid_text = gid_text or env.get("IMAGETUNE_GID", "").strip()
    try:
        uid = int(uid_text)
        if gid_text:
            return uid, int(gid_text)
    except ValueError:
        raise Refusal(f"IMAGETUNE_UID must be a number or uid:gid (IMAGETUNE_GID a number), not {spec!r}.") from None
    try:
        return uid, pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid, uid


def prepare_workspace(layout: dict[str, Path]) -> list[Path]:
    """Create the workspace folders that do not exist yet; return those it created, parents first."""
    created: list[Path] = []
    for key in ("workspace", "runs", "datasets", "imagetune_home", "presets", "hf_home"):
        path = layout[key]
        missing = [p for p in (path, *path.parents) if not p.exists()]
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Refusal(f"Cannot create {path} ({exc.strerror}). The workspace must be writable by the user the "
                          f"container runs as (uid {os.geteuid()}): mount a writable folder at "
                          f"{layout['workspace']}, or start the container as root (the default) so that it can hand "
                          "the folders to the right user.") from None
        created += [p for p in reversed(missing) if p not in created]
    return created


def user_env(uid: int, gid: int, layout: dict[str, Path], env: dict[str, str]) -> dict[str, str]:
    """HOME, USER and LOGNAME for a dropped user (torch and others call getpass.getuser(); HOME must be writable):
    the passwd entry's home if that user owns it, else IMAGETUNE_HOME/home."""
    try:
        entry = pwd.getpwuid(uid)
        name, home = entry.pw_name, Path(entry.pw_dir)
    except KeyError:
        name, home = f"uid{uid}", Path("/nonexistent")
    if not (home.is_dir() and home.stat().st_uid == uid):
        home = layout["imagetune_home"] / "home"
        if not home.exists():
            home.mkdir(parents=True)
            os.chown(home, uid, gid)
    return {**env, "HOME": str(home), "USER": name, "LOGNAME": name}


def drop_privileges(uid: int, gid: int) -> None:
    try:
        os.initgroups(pwd.getpwuid(uid).pw_name, gid)
    except KeyError:
        os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)


# --------------------------------------------------------------------------------------------------------------
# The web UI's supervisor: runs started from the UI must end with a checkpoint when the container stops
# --------------------------------------------------------------------------------------------------------------
#
# Headless, launch.py is the process tini signals, and it turns SIGTERM into a graceful stop itself: exec is enough.
# The web UI is different. It starts each run (torchrun, or a one-process run's worker) in a session of its own, on
# purpose: on a workstation a run outlives the UI, and a new UI re-attaches to it. In a container nothing outlives PID 1: when the UI exits, tini
# exits and the kernel kills every process left, runs included, without a checkpoint. So in UI mode this script
# stays as the UI's parent (a child subreaper, so that runs the UI leaves behind stay its descendants) and, when
# the UI ends for any reason (docker stop, Ctrl-C, a crash), asks each run it started for a graceful stop (the STOP
# file: checkpoint, then `stopped`) and waits for them before exiting. A second signal kills the runs instead.

PR_SET_CHILD_SUBREAPER = 36
TORCHRUN_MODULES = ("trainer.engine.torchrun", "torch.distributed.run")  # the launcher's, and torchrun's own
WORKER_MODULE = "trainer.engine.worker"  # a one-process run is its worker, started without torchrun


def become_subreaper() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat_line.rsplit(")", 1)[1].split()[1])  # after the (comm), which may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def _run_dir_after(argv: list[str], flag: str) -> Path | None:
    i = argv.index(flag) if flag in argv else -1
    return Path(argv[i + 2]) if 0 <= i and i + 2 < len(argv) and argv[i + 2] else None


def descendant_runs(root_pid: int) -> dict[int, Path | None]:
    """Runs below root_pid: {pid: its run folder}. A run is a torchrun (its folder is the argument after
    `--module MODULE`) or, for a one-process run, the worker started without torchrun (`-m trainer.engine.worker
    RUN_DIR`); the workers below a torchrun are its own, not runs of their own."""
    children, found, todo = _children_map(), {}, [root_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                todo.append(pid)
                continue
            if any(m in argv for m in TORCHRUN_MODULES) or (argv and Path(argv[0]).name == "torchrun"):
                found[pid] = _run_dir_after(argv, "--module")
            elif any(a == "-m" and b == WORKER_MODULE for a, b in zip(argv, argv[1:])):
                found[pid] = _run_dir_after(argv, "-m")
            else:
                todo.append(pid)
    return found


def _reap(ui_pid: int) -> int | None:
    """Reap every exited child (the UI, and the orphans we adopted); the UI's exit code when it was among them."""
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == ui_pid:
            code = os.waitstatus_to_exitcode(raw)
            status = 128 - code if code < 0 else code


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def supervise(argv: list[str], env: dict[str, str], poll_s: float = 0.2) -> int:
    import signal
    import subprocess
    import time

    me = os.getpid()
    become_subreaper()
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    ui = subprocess.Popen(argv, env=env)
    ui_status, handled, runs = None, 0, {}
    while True:
        time.sleep(poll_s)
        status = _reap(ui.pid)
        if status is not None:
            ui_status, ui.returncode = status, status
        if handled == 0 and (received or ui_status is not None):
            handled = 1
            runs = descendant_runs(me)
            if runs:
                names = ", ".join(str(d.name) if d else f"pid {p}" for p, d in runs.items())
                print(f"imagetune: stopping {len(runs)} run(s) with a checkpoint before the container exits: {names}"
                      " (a second signal kills them)", file=sys.stderr, flush=True)
            for run_dir in runs.values():
                if run_dir is not None:
                    try:
                        (run_dir / "STOP").touch()
                    except OSError as exc:
                        print(f"imagetune: cannot ask {run_dir} to stop: {exc.strerror}", file=sys.stderr)
            if ui_status is None:
                ui.send_signal(received[0])
        elif handled == 1 and len(received) > 1:
            handled = 2
            print("imagetune: killing the runs (no checkpoint)", file=sys.stderr, flush=True)
            for pid in runs:
                try:
                    os.killpg(pid, signal.SIGTERM)  # a run leads its own session: torchrun and its workers
                except OSError:
                    pass
            if ui_status is None:
                ui.send_signal(signal.SIGKILL)
        if ui_status is not None and handled and not any(_alive(pid) for pid in runs):
            _reap(ui.pid)
            return ui_status


def healthcheck(args: list[str] | None = None, env: dict[str, str] | None = None, timeout: float = 5.0) -> int:
    """0 when healthy. In UI mode: the web UI answers HTTP at all, with any status below 500. With a login, Gradio
    answers / with its login page (200) and its API routes with 401: either proves the server is up, and accepting
    401 keeps the check right whatever route the app protects. In headless or command mode there is no server: the
    container is healthy for as long as its process runs (Docker stops checking when it exits).

    The mode comes from PID 1's command line (tini -- python entrypoint.py ARGS), so no state file can go stale."""
    env = dict(os.environ if env is None else env)
    if args is None:
        try:
            cmdline = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            return 0
        names = [Path(a).name for a in cmdline]
        if "entrypoint.py" not in names:
            return 0  # not started through this entrypoint: nothing known to probe
        args = cmdline[names.index("entrypoint.py") + 1:]
    if mode_of(args) != "ui":
        return 0
    url = f"http://127.0.0.1:{ui_port(args, env)}/"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    print(f"{url}: HTTP {status}")
    return 0 if status < 500 else 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    if mode_of(args) == "healthcheck":
        return healthcheck()
    as_root = os.geteuid() == 0
    try:
        chosen = plan(args, env)
        layout = workspace_layout(env)
        created = prepare_workspace(layout)
        uid, gid = target_ids(env, layout["workspace"]) if as_root else (os.geteuid(), os.getegid())
    except Refusal as exc:
        print(f"imagetune: {exc}", file=sys.stderr)
        return 2
    run_env = {**env, **chosen.env}
    if chosen.mode == "ui":  # the login now travels as IMAGETUNE_AUTH alone
        run_env.pop("IMAGETUNE_USERNAME", None)
        run_env.pop("IMAGETUNE_PASSWORD", None)
    drop = as_root and uid != 0
    if drop:
        for path in created:
            os.chown(path, uid, gid)
        run_env = user_env(uid, gid, layout, run_env)
    if chosen.mode == "ui":
        login = f"login: {chosen.login}" if chosen.login else "no login"
        print(f"imagetune: web UI on port {ui_port(args, env)} ({login}); workspace {layout['workspace']}; uid {uid}",
              file=sys.stderr)
    elif chosen.mode == "headless":
        print(f"imagetune: headless; runs in {layout['runs']}; uid {uid}", file=sys.stderr)
    sys.stderr.flush()
    os.chdir(layout["workspace"])  # relative paths (data.path=datasets/dogs) are relative to the workspace
    if drop:
        drop_privileges(uid, gid)
    try:
        if chosen.mode == "ui":
            return supervise(chosen.argv, run_env)
        os.execvpe(chosen.argv[0], chosen.argv, run_env)  # becomes this process: tini's signals reach it
    except OSError as exc:
        print(f"imagetune: cannot run {chosen.argv[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
