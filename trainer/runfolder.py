"""The run folder's files, as the launcher sees them: a fresh folder per run, its self-contained config,
checkpoints, STOP, and the logs torchrun leaves behind when a rank dies. Torch-free (the demo builder is imported
only for a `demo://` path), so the web UI can use it too.

Layout (see DESIGN.md): `config.yaml`, `plan.json`, `events.jsonl`, `train.log`, `launcher.pid`, `logs/`
(torchrun's per-rank logs), `checkpoints/step-NNNNNN/` (complete when they hold a `COMPLETE` marker), `STOP`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.config import Config
from trainer.config.validate import DEMO_SCHEME, is_hub_id
from trainer.errors import UserError
from trainer.stopping import STOP_FILE

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
LOG_FILE = "train.log"
PID_FILE = "launcher.pid"
LOGS_DIR = "logs"

DEMO_DIR = ".demo"  # under the runs folder: the demo model and data are built there once and shared by runs

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_run_name(name: str) -> None:
    # The name becomes a folder (and torchrun's rendezvous id), so slashes, `..` or spaces must not get through.
    if not isinstance(name, str) or not _NAME.fullmatch(name):  # match() would let 'evil\n' through ($)
        raise UserError(
            f"Run name {name!r} cannot be used as a folder name. Use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit), for example name=my-dog-lora."
        )


def create_run_dir(runs_dir: str | Path, name: str) -> Path:
    """Create `runs_dir/name`, or `name-2`, `name-3`... if taken. Never reuses an existing folder.

    `mkdir(exist_ok=False)` is the atomic claim: two launches racing for the same name get different folders.
    """
    check_run_name(name)
    runs_dir = Path(runs_dir).expanduser().resolve()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"Cannot create the runs folder '{runs_dir}': {exc.strerror}. Pick another with --runs-dir.") from None
    for n in range(1, 10_000):
        candidate = runs_dir / (name if n == 1 else f"{name}-{n}")
        try:
            candidate.mkdir(exist_ok=False)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"Cannot create the run folder '{candidate}': {exc.strerror}.") from None
        return candidate
    raise UserError(f"Too many runs named '{name}' in {runs_dir}; choose another name (name=...).")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so a reader (the UI) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_plan(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / PLAN_FILE).read_text(encoding="utf-8"))


def request_stop(run_dir: str | Path) -> Path:
    """Ask the workers for a graceful stop (checkpoint, then `stopped`)."""
    path = Path(run_dir) / STOP_FILE
    path.touch()
    return path


# `demo://NAME` -> the "module:function" that builds it (once) under a root folder and returns {name: path}.
DEMO_BUILDERS = {
    "tiny-sd": "trainer.demo:ensure_demo_assets",
    "demo-data": "trainer.demo:ensure_demo_assets",
    "shapes-coco": "trainer.detection_demo:ensure_detection_demo",
}
_BUILD_DEMO = """import importlib, json, sys
found = {}
for spec in sys.argv[2:]:
    module, function = spec.split(":")
    found.update(getattr(importlib.import_module(module), function)(sys.argv[1]))
print(json.dumps({k: str(v) for k, v in found.items()}))"""


def demo_assets(root: Path, names=None) -> dict[str, Path]:
    """Build (once) and locate the offline demo assets `names` (default: all). Building may need torch and
    diffusers, so it runs in a child process: the launcher, and the web UI that calls it, stay free of torch."""
    wanted = DEMO_BUILDERS if names is None else [n for n in names if n in DEMO_BUILDERS]
    builders = sorted({DEMO_BUILDERS[n] for n in wanted})
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", _BUILD_DEMO, str(root), *builders], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"Could not build the offline demo assets in {root}: {last}")
    return {name: Path(path) for name, path in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def resolve_paths(config: Config, runs_dir: str | Path) -> Config:
    """A copy of `config` with `demo://NAME` built and resolved, and local paths made absolute, so that the
    run folder's config.yaml still means the same thing from another working directory (or on resume)."""
    config = copy.deepcopy(config)
    demo_keys = [k for k in ("model.path", "data.path") if _get(config, k).startswith(DEMO_SCHEME)]
    if demo_keys:
        names = [_get(config, key)[len(DEMO_SCHEME):] for key in demo_keys]
        for key, name in zip(demo_keys, names):
            if name not in DEMO_BUILDERS:
                known = ", ".join(f"demo://{a}" for a in DEMO_BUILDERS)
                raise UserError(f"{key}: unknown demo asset '{name}'; the demo has {known}.")
        assets = demo_assets(Path(runs_dir).expanduser().resolve() / DEMO_DIR, names)
        for key, name in zip(demo_keys, names):
            _set(config, key, str(assets[name]))
    keys = ["model.path", "model.config", "data.path", "prior.class_path"]
    if config.model.family == "detection":  # model.path names an architecture; the weights may be a local file
        keys = ["data.path", "detection.images", "detection.val_path"]
        keys += [] if config.detection.weights in ("coco", "none") else ["detection.weights"]
    for key in keys:
        value = _get(config, key)
        if value and not value.startswith(DEMO_SCHEME) and not is_hub_id(value):
            _set(config, key, str(Path(value).expanduser().resolve()))
    return config


def _get(config: Config, key: str):
    obj = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj if obj is not None else ""


def _set(config: Config, key: str, value) -> None:
    *head, last = key.split(".")
    obj = config
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)


# ----------------------------------------------------------------------------------------------------------------
# What torchrun says when a rank dies


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int


# torchrun's summary: "Root Cause (first observed failure):" then "rank : 1 (local_rank: 1)" and
# "exitcode : -9 (pid: 123)". Only the root cause names the rank that failed first; the others were stopped.
_ROOT = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*"
    r"exitcode\s*:\s*(-?\d+)",
    re.S,
)


def parse_root_cause(text: str) -> RankFailure | None:
    matches = list(_ROOT.finditer(text))
    if not matches:
        return None
    rank, local_rank, code = matches[-1].groups()
    return RankFailure(int(rank), int(local_rank), int(code))


def tail_lines(path: Path, count: int = 20, max_bytes: int = 64_000) -> list[str]:
    """The last `count` non-empty lines of a (possibly large) text file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = [line.rstrip() for line in data.decode("utf-8", "replace").splitlines()]
    return [line for line in lines if line.strip()][-count:]


def rank_log_files(run_dir: str | Path, local_rank: int) -> list[Path]:
    """This launch's log files of one local rank: `logs/<rdzv id>_<random>/attempt_<n>/<local_rank>/std*.log`.

    Every launch (a resume is a new launch) gets a new `<rdzv id>_<random>` folder; the newest is this one.
    """
    root = Path(run_dir) / LOGS_DIR
    if not root.is_dir():
        return []
    launches = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return []
    attempts = sorted(launches[-1].glob("attempt_*"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return []
    folder = attempts[-1] / str(local_rank)
    return [p for p in (folder / "stderr.log", folder / "stdout.log") if p.is_file()]


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _exit_advice(exitcode: int) -> str:
    """What a user can do about an exit code, in a sentence."""
    if exitcode == -signal.SIGKILL:
        return (
            "SIGKILL usually means the system ran out of memory (see `dmesg`): lower batch.per_device or "
            "data.resolution, enable train.gradient_checkpointing, or use fewer processes."
        )
    if exitcode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):
        return "Something outside the run stopped it (a kill, a logout, a job scheduler); resume it with --resume."
    return "Its last log lines below show the error; fix what they name, then resume with --resume or start again."


def describe_failure(run_dir: str | Path, returncode: int, log_offset: int = 0, node_rank: int = 0) -> dict:
    """The fields of the `failed` event for a torchrun that exited without a final event: which rank died
    and how (from torchrun's summary in this launch's part of train.log), and that rank's last log lines."""
    run_dir = Path(run_dir)
    cause = parse_root_cause(_read_from(run_dir / LOG_FILE, log_offset))
    if cause is not None:
        where, lines = LOG_FILE, []
        for path in rank_log_files(run_dir, cause.local_rank):  # stderr first: that is where tracebacks go
            where, lines = str(path.relative_to(run_dir)), tail_lines(path)
            if lines:
                break
        if not lines:  # no per-rank file (torchrun failed early): the rank's lines tee'd into train.log
            where = LOG_FILE
            prefix = f"[rank{cause.rank}]"
            lines = [line for line in tail_lines(run_dir / LOG_FILE, 400) if line.startswith(prefix)][-20:]
        reason = (
            f"Rank {cause.rank} (local rank {cause.local_rank} on node {node_rank}) {_describe_exit(cause.exitcode)}."
            f" {_exit_advice(cause.exitcode)} Last lines of {where}:\n" + "\n".join(lines or ["(it printed nothing)"])
        )
        return {"reason": reason, "rank": cause.rank, "exitcode": cause.exitcode, "log": where}
    if returncode == 0:
        head = "The workers exited without reporting how the run ended (no done/stopped event); this is a bug."
    else:
        head = (
            f"torchrun {_describe_exit(returncode)} before any worker reported an error. {_exit_advice(returncode)}"
            " For a multi-node run, check that every node started and can reach distributed.master_addr:port."
        )
    lines = tail_lines(run_dir / LOG_FILE)
    return {"reason": f"{head} Last lines of {LOG_FILE}:\n" + "\n".join(lines), "exitcode": returncode}


def _read_from(path: Path, offset: int, max_bytes: int = 2_000_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, os.path.getsize(path) - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
