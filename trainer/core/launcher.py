"""Start, watch, stop and resume runs: the one path both front-ends (launch.py and the web UI) take.

A run is torchrun in its own session (so a Ctrl-C in the terminal or a GUI restart does not reach the workers;
they are stopped through the STOP file, or killed with their whole process tree by trainer.core.proctree). A
one-process, one-node run skips torchrun's agent: its one worker is started directly, in its own session, with the
environment torchrun would give it (`single_process`), which saves the agent's start-up and memory; the worker's
pid is then the run's process (launcher.pid, run.lock, what Stop and Kill signal). The workers write the run's events;
the launcher writes the first one (`plan`, or `resumed`) and, when the workers die without a final event,
the `failed` event that names the rank and shows its last log lines.

Torch is imported only in child processes: the hardware probe (when no Hardware is passed in, for a GPU plan)
and the demo-asset builder, so this module's callers (launch.py, the web UI) stay torch-free. Folder details live in trainer.core.runfolder, resume in trainer.core.resume.

    run_dir, plan = prepare_run(config, "runs")        # or trainer.core.resume.resume_run(run_dir, [...])
    proc = start_run(run_dir, plan, config)            # proc.request_stop() / proc.kill()
    final = proc.wait()                                # the run's one final event (done/stopped/failed)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from typing import Mapping
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainer.core.config import Config, to_yaml
from trainer.core.config.validate import parse_devices
from trainer.core.checkpoint import Checkpoint, latest_checkpoint
from trainer.core.events import (DoneEvent, Event, EventLog, FailedEvent, PlanEvent, StoppedEvent, WarningEvent,
                                 final_event, read_events)
from trainer.core.hardware import Hardware
from trainer.core.plan import Plan, make_plan
from trainer.core.proctree import ended, kill_tree
from trainer.core.assets import resolve_paths
from trainer.core.failures import describe_failure
from trainer.core.runfolder import RunFolder, check_run_name, create_run_dir, write_atomic
from trainer.core.runlock import RunLock, release_lock, write_identity
from trainer.core.runlog import launcher_echo
from trainer.core.stall import StallWatch
from trainer.errors import UserError
from trainer.core.registry import spec_of

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_MODULE = "trainer.engine.worker"
TORCHRUN_MODULE = "trainer.engine.torchrun"  # torch.distributed.run, ending without the interpreter's teardown


@functools.lru_cache(maxsize=None)
def _torchrun_has(flag: str) -> bool:
    """Whether this torch's torchrun takes `flag` (some are newer than torch 2.11), read from its source file:
    asking `torchrun --help` or importing torch would cost seconds in a process that stays torch-free."""
    spec = importlib.util.find_spec("torch")  # a top-level name: found without importing it
    if spec is None or not spec.submodule_search_locations:
        return False
    run_py = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "run.py"
    try:
        return f'"{flag}"' in run_py.read_text(errors="replace")
    except OSError:
        return False


def _probe(hw: Hardware | None, config: Config) -> Hardware:
    if hw is not None:
        return hw
    try:
        if parse_devices(config.devices)[0] == "cpu":
            # A cpu:N plan does not depend on the GPUs; skipping probe() saves importing torch (seconds).
            return Hardware(cpu_count=os.cpu_count() or 1)
    except ValueError:
        pass  # make_plan reports it
    from trainer.core.hardware import probe_in_subprocess  # torch stays out of this process (the UI's too)

    return probe_in_subprocess()


def plan_for(config: Config, hw: Hardware | None = None) -> Plan:
    """The plan of `config` on this machine (or on `hw`); raises ConfigError. Creates nothing."""
    from trainer.core.model_size import trained_parameters

    hw = _probe(hw, config)
    parameters = trained_parameters(config.model.family, config.model.path) if config.method == "full" else None
    return make_plan(config, hw, parameters)


# ----------------------------------------------------------------------------------------------------------------
# Preparing a run folder


def check_data(config: Config):
    """Scan the dataset before any process starts: a dataset that cannot train is the user's mistake to
    report now (exit 2, nothing created), not a failed run a minute later. Each family has its own torch-free
    check (its spec's `data_check`: captioned images, detection annotations...). Per-file warnings (corrupt
    files, missing captions, bad boxes) come from the workers as `warning` events."""
    return spec_of(config.model.family).run_data_check(config)  # a scan (the plan lists its buckets)


def prepare_run(config: Config, runs_dir: str | Path, hw: Hardware | None = None, *,
                cluster: str = "") -> tuple[Path, Plan]:
    """Plan the run, then create its folder (never reusing one) with config.yaml, plan.json and the `plan` event.

    Raises ConfigError/UserError before anything is created on disk (except the shared demo assets).
    Every node of a multi-node run calls this on its own machine; only global rank 0 (on node 0) writes the
    workers' events, so the other nodes' folders hold the config, the logs and the launcher's own events.
    """
    check_run_name(config.name)
    plan = replace(plan_for(config, hw), cluster=cluster)  # cluster: where distributed.* came from (SLURM)
    config = resolve_paths(config, runs_dir)
    scan = check_data(config)
    plan = plan.with_buckets(config, scan).with_held_out(scan).with_caches(config, scan)
    run_dir = create_run_dir(runs_dir, config.name)
    folder = RunFolder(run_dir)
    try:
        RunLock(run_dir).acquire()  # handed to torchrun by start_run, released when its workers end
        write_atomic(folder.config, to_yaml(config))
        write_atomic(folder.plan, json.dumps(plan.event(), indent=2) + "\n")
        EventLog(run_dir, echo=launcher_echo(run_dir)).emit(
            PlanEvent.of(plan.event(), node_rank=config.distributed.node_rank))
    except OSError as exc:
        # A half-made folder would list as a broken run and keep its name taken.
        shutil.rmtree(run_dir, ignore_errors=True)
        raise UserError(f"Could not write the run folder {run_dir}: {exc.strerror or exc}. Free some space on "
                        f"{run_dir.parent} (or pick another --runs-dir) and start again.") from None
    return run_dir, plan


# ----------------------------------------------------------------------------------------------------------------
# The command: torchrun, or the one worker itself


def single_process(plan: Plan) -> bool:
    """Whether the run is one process on one node: its worker is started without torchrun's agent (which costs
    seconds of start-up and hundreds of MB; with one process it has nobody to rendezvous with or watch over)."""
    return plan.nodes == 1 and plan.world_size == 1


def build_command(
    run_dir: str | Path,
    plan: Plan,
    config: Config,
    resume: str | Path | None = None,
    worker_module: str = WORKER_MODULE,
) -> list[str]:
    """torchrun's command line: one process per device (plan.processes_per_node) on this node; for a one-process
    run (`single_process`), the worker's own command line, the one torchrun would run (build_env gives it
    torchrun's environment)."""
    run_dir = Path(run_dir)
    tail = [str(run_dir), *(["--resume", str(resume)] if resume is not None else [])]
    if single_process(plan):
        return [sys.executable, "-u", "-m", worker_module, *tail]
    cmd = [sys.executable, "-m", TORCHRUN_MODULE]
    if plan.nodes > 1:
        d = config.distributed
        # The static rendezvous, not c10d: c10d ignores --node-rank (torchrun warns so) and numbers the nodes by
        # sorting their (host address, pid) descriptors, so global rank 0 could land on any machine. Static makes
        # group rank = --node-rank, hence global rank = node_rank * nproc + local_rank, and rank 0 (the events
        # writer) is on node 0, whose launcher created the run folder the user watches. Node 0's agent hosts the
        # TCPStore on master_port; the others wait up to timeout_s for it.
        cmd += [
            "--nnodes", str(plan.nodes), "--node-rank", str(d.node_rank), "--rdzv-backend", "static",
            "--master-addr", d.master_addr, "--master-port", str(d.master_port),
            "--rdzv-id", config.name, "--rdzv-conf", f"timeout={d.timeout_s}",
        ]
    else:
        # A c10d store on a free port: several single-node runs can share a machine without port clashes.
        cmd += ["--standalone", "--nnodes", "1"]
    cmd += [
        "--nproc-per-node", str(plan.processes_per_node), "--max-restarts", "0",
        # Per-rank stdout/stderr files under logs/ (read back when a rank dies) and, through --tee, the same
        # lines on torchrun's console (-> train.log) prefixed with the global rank.
        "--log-dir", str(RunFolder(run_dir).logs), "--redirects", "3", "--tee", "3",
        *(["--log-line-prefix-template", "[rank${rank}]: "] if _torchrun_has("--log-line-prefix-template") else []),
        "--module", worker_module, *tail,
    ]
    return cmd


# What torchrun's agent sets for each worker (torch.distributed.elastic.agent.server.local_elastic_agent), for a
# run of one process on one node. The agent's own store is replaced by one the worker hosts: torch's env://
# rendezvous makes rank 0 start a TCPStore on MASTER_PORT, and port 0 lets the system pick a free port (no other
# process needs to find it), so runs sharing a machine cannot clash.
SINGLE_PROCESS_ENV = {
    "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
    "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "False",  # there is no agent: the worker hosts the store
}


def repo_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) with this checkout first on PYTHONPATH: what a child that
    runs this repo's modules (`python -m launch`, `-m trainer...`) needs, from a checkout or an installed package."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def build_env(plan: Plan, base: dict | None = None, run_id: str = "imagetune") -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if single_process(plan):
        env.update(SINGLE_PROCESS_ENV)
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        env["TORCHELASTIC_RUN_ID"] = run_id
        env.pop("TORCHELASTIC_ERROR_FILE", None)  # another launch's (a launcher started under torchrun)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach train.log (and the UI) as they are printed
    env = repo_env(env)
    if plan.device == "cuda":
        # The plan's ids count the GPUs this process sees; if CUDA_VISIBLE_DEVICES already narrows them,
        # translate through it rather than re-exposing physical GPUs 0..n.
        visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        ids = [visible[i] if i < len(visible) else str(i) for i in plan.gpu_ids] if visible else map(str, plan.gpu_ids)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU plan must not create CUDA contexts on a shared GPU machine
        # OpenMP's threads spin while they wait for work: on cores shared with another run, the UI or other
        # tenants they burn the cycles those need. Sleeping instead, a demo step took 0.31 CPU-s, not 0.41-0.69
        # (bench/ui_load.py, bench/README.md). A user's own setting wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "OMP_NUM_THREADS" not in env:
        # Without it torchrun sets 1 thread (CPU training crawls) or each rank takes every core (oversubscribed).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // plan.processes_per_node))
    return env


# ----------------------------------------------------------------------------------------------------------------
# A running run

STALL_POLL_S = 2.0  # how often a waiting launcher reads its ranks' heartbeats (trainer.core.stall)


@dataclass
class RunProcess:
    """torchrun (or the one worker of a one-process run) started by `start_run`; `wait()` guarantees the run ends
    with exactly one final event.

    The stall watch runs in a thread of its own (`watch()`, started by start_run), not inside wait(): launch.py's
    follow() polls, a UI thread waits, a node > 0 launcher only follows its own torchrun, and each of them once
    missed the watch. Owned by the process object, it runs however (and whether) the run is followed."""

    run_dir: Path
    plan: Plan
    process: subprocess.Popen
    node_rank: int = 0
    log_offset: int = 0  # where this launch's output starts in train.log
    resumed_from: Checkpoint | None = None
    changes: dict = field(default_factory=dict)
    killed: bool = False  # kill() was called: the `failed` reason says so instead of guessing
    stall: StallWatch | None = None  # trainer.core.stall: watched while waiting
    stalled: str | None = None  # why the stall watch ended the run
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _final: dict | None = field(default=None, repr=False)
    _watcher: threading.Thread | None = field(default=None, repr=False)
    _ended: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def request_stop(self) -> None:
        """Graceful: the workers checkpoint at the next step boundary and end with `stopped`."""
        RunFolder(self.run_dir).request_stop()

    def kill(self, grace_s: float = 10.0) -> None:
        """SIGTERM torchrun (it passes it on to the workers) or the one worker, SIGKILL the whole tree if alive
        after grace_s."""
        self.killed = True
        kill_tree(self.process.pid, grace_s, self.process)

    def watch(self) -> RunProcess:
        """Start the stall watch (once): a daemon thread that reads the ranks' heartbeats every STALL_POLL_S while
        the process lives, emits the `warning` and, past the timeout, kills the run (wait() then writes `failed`)."""
        with self._lock:
            if self.stall is not None and self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                                 name=f"stall-{self.run_dir.name}")
                self._watcher.start()
        return self

    def _watch_loop(self) -> None:
        # poll() rather than process.wait(): a thread blocked in wait() holds Popen's waitpid lock, and poll()
        # then answers None without blocking; wait() sets _ended once the process is gone.
        while not self._ended.wait(STALL_POLL_S) and self.process.poll() is None:
            try:
                self._watch_stall()
            except Exception as exc:  # an unreadable heartbeat folder must not end the watch silently
                print(f"imagetune: stall watch of {self.run_dir}: {exc}", file=sys.stderr)

    def wait(self, timeout: float | None = None) -> dict:
        """Wait for torchrun (or the one worker) to exit, then return the run's final event, writing `failed` if
        there is none."""
        self.process.wait(timeout)
        self._ended.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()  # a kill in progress decides the `failed` reason (self.stalled)
        with self._lock:
            if self._final is None:
                self._final = self._finish(self.process.returncode)
                release_lock(self.run_dir, self.process.pid)
        return self._final

    def _watch_stall(self) -> None:
        if self.stall is None or self.stalled is not None:
            return
        warning, reason = self.stall.check(time.time())
        if warning:
            EventLog(self.run_dir, echo=launcher_echo(self.run_dir)).emit(WarningEvent(message=warning))
        if reason:
            ckpt = latest_checkpoint(self.run_dir)
            where = (f"continue from its last checkpoint ({ckpt.path.relative_to(self.run_dir)}) with: python "
                     f"launch.py --resume {self.run_dir}") if ckpt else "it has no checkpoint yet; start it again"
            self.stalled = f"{reason} {where}."
            self.kill(grace_s=5)

    def _finish(self, returncode: int) -> dict:
        final = final_event(read_events(self.run_dir))
        if final is not None:
            return final
        log = EventLog(self.run_dir, echo=launcher_echo(self.run_dir))  # its `failed`, in train.log too
        if self.node_rank > 0:
            # Global rank 0 (node 0) writes the run's events; this node's folder still needs an ending.
            note = "the run's events, samples, checkpoints and outputs are in node 0's run folder"
            if returncode == 0:
                extra = {"node_rank": self.node_rank, "message": f"node {self.node_rank} finished; {note}"}
                ending: Event = (StoppedEvent(extra=extra) if RunFolder(self.run_dir).stop_file.exists()
                                 else DoneEvent(extra=extra))
                return log.emit_final(ending)
        if self.stalled:
            return log.emit_final(FailedEvent(exitcode=returncode, reason=self.stalled, killed=True))
        if self.killed or RunFolder(self.run_dir).kill_file.exists():  # by us, or by a UI through kill_run
            return log.emit_final(FailedEvent(exitcode=returncode, killed=True, reason=killed_reason(self.run_dir)))
        failure = describe_failure(self.run_dir, returncode, self.log_offset, self.node_rank,
                                   single_process=single_process(self.plan))
        return log.emit_final(FailedEvent(reason=failure.pop("reason"), exitcode=failure.pop("exitcode", returncode),
                                    extra=failure))


def start_run(
    run_dir: str | Path,
    plan: Plan,
    config: Config,
    resume: str | Path | None = None,
    worker_module: str = WORKER_MODULE,
) -> RunProcess:
    """Start torchrun (or, for one process, the worker itself) for a prepared run folder in its own process group;
    output is appended to train.log."""
    run_dir = Path(run_dir).resolve()
    log_path = RunFolder(run_dir).log
    offset = log_path.stat().st_size if log_path.exists() else 0
    cmd = build_command(run_dir, plan, config, resume, worker_module)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=build_env(plan, run_id=run_dir.name),
                start_new_session=True,  # own process group: killpg reaches every worker, terminal Ctrl-C does not
            )
        except OSError:
            release_lock(run_dir, os.getpid())
            raise
    folder = RunFolder(run_dir)
    folder.record_launcher(process.pid)  # with its start time (trainer.core.runlock)
    write_identity(folder.lock, process.pid)  # the lock lives as long as torchrun (or the one worker), even if we do not
    d = config.distributed
    first = d.node_rank * plan.processes_per_node
    stall = StallWatch(run_dir, tuple(range(first, first + plan.processes_per_node)), d.stall_warning_s,
                       d.stall_timeout_s)
    return RunProcess(run_dir, plan, process, node_rank=d.node_rank, log_offset=offset, stall=stall).watch()


def killed_reason(run_dir: str | Path) -> str:
    """What a killed run's `failed` event says: that Kill ended it, and where it can go on from, truly."""
    ckpt = latest_checkpoint(run_dir)
    where = (f"continue it from its last checkpoint ({ckpt.path.relative_to(run_dir)}, step {ckpt.step}) with: "
             f"python launch.py --resume {run_dir}" if ckpt else
             "it had saved no checkpoint, so it cannot be resumed: start it again")
    return f"The run was killed on request before it could stop gracefully; {where}."


def kill_run(run_dir: str | Path, grace_s: float = 10.0) -> bool:
    """Kill a run started by another process (e.g. before a GUI restart) through its launcher.pid; if its own
    launcher is gone too and so writes no ending, the `failed` event that says it was killed is written here."""
    folder = RunFolder(Path(run_dir))
    pid = folder.launcher_pid()
    if final_event(read_events(run_dir)) is not None or pid is None:
        return False  # nothing to kill; a recorded pid that now belongs to another process is never signalled
    folder.kill_file.touch()  # a launcher that still waits on its workers (a terminal's) then says they were killed
    kill_tree(pid, grace_s)
    if ended(pid):  # its own launcher may be writing the ending now too: emit_final keeps one of the two
        log = EventLog(run_dir, echo=launcher_echo(run_dir))
        log.emit_final(FailedEvent(killed=True, reason=killed_reason(run_dir)))
    return True
