"""Starting, stopping, resuming and deleting runs from the UI, through trainer.core.launcher (never torch here).

Runs are torchrun process groups of their own: they outlive the UI. A run this UI started is waited for by a
daemon thread (RunProcess.wait() writes the `failed` event if the workers die without a final event); a run
started elsewhere is stopped through its STOP file and killed through its launcher.pid.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from app.runs import read_run
from trainer.core.config import Config
from trainer.core.config.validate import parse_devices
from trainer.errors import UserError
from trainer.core.hardware import Hardware, probe_in_subprocess
from trainer.core import queue
from trainer.core.assets import DEMO_DIR, demo_assets
from trainer.core.runfolder import request_stop

if TYPE_CHECKING:  # imported where used at run time, like the rest of the launcher
    from trainer.core.launcher import RunProcess

log = logging.getLogger("imagetune.app")
DEFAULT_DEMO = ("tiny-sd", "demo-data")  # what presets/demo.yaml uses: built when the UI starts


class HardwareCache:
    """The GPUs of this machine, probed once per UI start in a child process (torch stays out of the UI)."""

    def __init__(self, probe: Callable[[], Hardware] = probe_in_subprocess, hw: Hardware | None = None):
        self._future: Future = Future()
        self.error: str | None = None
        if hw is not None:
            self._future.set_result(hw)
        else:
            threading.Thread(target=self._run, args=(probe,), daemon=True, name="hardware-probe").start()

    def _run(self, probe) -> None:
        try:
            self._future.set_result(probe())
        except Exception as exc:  # no torch, a broken driver...: plan for the CPU and say why
            self.error = str(exc)
            log.warning("hardware probe failed: %s", exc)
            self._future.set_result(Hardware(cpu_count=os.cpu_count() or 1, notes=(f"GPU probe failed: {exc}",)))

    def ready(self) -> bool:
        return self._future.done()

    def get(self, timeout: float | None = 300) -> Hardware:
        return self._future.result(timeout)

    def for_config(self, config: Config, wait: float = 0) -> Hardware | None:
        """The hardware to plan `config` on; a cpu:N plan needs no probe. None while the probe runs."""
        try:
            if parse_devices(config.devices)[0] == "cpu":
                return self.get(0) if self.ready() else Hardware(cpu_count=os.cpu_count() or 1)
        except ValueError:
            pass
        if not self.ready() and wait <= 0:
            return None
        return self.get(wait)

    def describe(self) -> str:
        if not self.ready():
            return "Checking this machine's GPUs…"
        hw = self.get(0)
        if not hw.gpu_count:
            why = f" ({self.error})" if self.error else ""
            return f"No GPU found{why}: runs use the CPU ({hw.cpu_count} cores). Fine for the demo, slow for real models."
        names = ", ".join(sorted(set(hw.gpu_names))) or "GPU"
        memory = f", {hw.gpu_memory_gb[0]:g} GB each" if hw.gpu_memory_gb else ""
        return f"{hw.gpu_count} × {names}{memory} · {'bf16' if hw.bf16 else 'fp16'}"


class Jobs:
    def __init__(self, runs_dir: str | Path, hardware: HardwareCache, workspace=None):
        self.runs_dir = Path(runs_dir).expanduser().resolve()
        self.hardware = hardware
        self.workspace = workspace  # app.security.Workspace: what an exposed UI may run (None: anything)
        self._procs: dict[Path, RunProcess] = {}
        self._waiters: dict[Path, threading.Thread] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="imagetune-job")
        # Every run starts from this one thread, made now at the priority the UI process started with: app.main
        # then lowers the priority of the threads that serve pages (lower_priority), and a process inherits the
        # priority of the thread that started it, so runs keep theirs.
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="imagetune-launcher")
        self._launcher.submit(lambda: None).result()  # its thread exists from here on (the pool makes it lazily)
        self._demo: Future | None = None
        self._closing = threading.Event()

    # -- the offline demo's model and data are built once, in the background, so Start is quick ---------------
    def warm_demo(self) -> None:
        if (self.runs_dir / DEMO_DIR / "tiny-sd").exists() and (self.runs_dir / DEMO_DIR / "demo-data").exists():
            return
        self._demo = self._pool.submit(demo_assets, self.runs_dir / DEMO_DIR, list(DEFAULT_DEMO))

    def demo_path(self, name: str) -> Path:
        """A built demo asset (`tiny-sd`, `demo-data`), building it first if needed."""
        if self._demo is not None:
            try:
                self._demo.result()
            except Exception:
                pass  # built again below, reporting the error
        return demo_assets(self.runs_dir / DEMO_DIR, [name])[name]

    # -- runs -------------------------------------------------------------------------------------------------
    def run_dir(self, name: str) -> Path:
        """The folder of run `name`, refusing anything that is not directly inside the runs folder."""
        path = (self.runs_dir / (name or "")).resolve()
        if not name or path.parent != self.runs_dir or not path.is_dir():
            raise UserError(f"There is no run named {name!r} in {self.runs_dir}.")
        return path

    def _watch(self, proc: RunProcess) -> None:
        waiter = threading.Thread(target=self._wait, args=(proc,), daemon=True, name=f"wait-{proc.run_dir.name}")
        with self._lock:
            self._procs[Path(proc.run_dir)] = proc
            self._waiters[Path(proc.run_dir)] = waiter
        waiter.start()

    def _wait(self, proc: RunProcess) -> None:
        try:
            proc.wait()  # writes `failed` if the workers died without a final event
        except Exception:
            log.exception("waiting for %s failed", proc.run_dir)
        finally:
            with self._lock:
                if self._procs.get(Path(proc.run_dir)) is proc:
                    del self._procs[Path(proc.run_dir)]

    def start(self, config: Config) -> Path | queue.Queued:
        """Start the run now, or queue it (its entry returned) while a run is alive or others wait before it."""
        if self._demo is not None and not self._demo.done():
            self._demo.result()  # the demo assets are being built: wait rather than build them twice
        self._approve(config)  # again here: whatever called start, the config it passes is the one that runs
        with queue.exclusive(self.runs_dir):  # no queue runner starts one between the look and the start
            if queue.must_wait(self.runs_dir, queue.config_devices(config.devices)):
                return queue.add(self.runs_dir, config)
            return self._launch(config)

    def _launch(self, config: Config) -> Path:
        from trainer.core.launcher import prepare_run, start_run

        self._approve(config)  # a queued config: approved again when it starts
        run_dir, plan = prepare_run(config, self.runs_dir, self.hardware.for_config(config, wait=300))
        self._watch(self._launcher.submit(start_run, run_dir, plan, config).result())
        return run_dir

    def start_queue_runner(self, poll_s: float = 2.0) -> None:
        """Start the queued runs (this UI's, another's, the command line's) as their devices come free: each poll
        starts the first that no live run, Generate or earlier entry holds (trainer.core.queue.start_next). Two
        UIs' runners take turns under the queue's lock."""
        def loop() -> None:
            while not self._closing.wait(poll_s):  # a poll of the runs folder, as the Runs tab's
                try:
                    got = queue.start_next(self.runs_dir, self._launch)
                except Exception:
                    log.exception("the queue runner could not start the next run")
                    continue
                if isinstance(got, tuple) and isinstance(got[1], UserError):
                    log.warning("queued run %s was not started: %s", got[0].name, got[1])
        threading.Thread(target=loop, daemon=True, name="queue-runner").start()

    def stop(self, name: str) -> None:
        request_stop(self.run_dir(name))

    def resume(self, name: str, overrides: Iterable[str] = ()) -> Path:
        from trainer.core.resume import resume_run

        run_dir = self.run_dir(name)
        with self._lock:
            previous = self._waiters.get(run_dir)
        if previous is not None:
            # The last launch's waiter must see its own final event before a `resumed` follows it (else it would
            # take the run for one that died without a final event); torchrun may take a moment to exit.
            previous.join(60)
            if previous.is_alive():
                raise UserError(f"Run {name} has not finished stopping yet; try Resume again in a moment.")
        hw = self.hardware.get(300)
        # The changed config is checked like a new run's, before anything is written (the lock is released).
        self._watch(self._launcher.submit(resume_run, run_dir, list(overrides), hw=hw,
                                          approve=self._approve).result())
        return run_dir

    def _approve(self, config: Config) -> None:
        if self.workspace is not None:
            self.workspace.approve(config)

    def kill(self, name: str) -> None:
        """Kill without a checkpoint (for a run that does not react to Stop); in the background."""
        from trainer.core.launcher import kill_run

        run_dir = self.run_dir(name)
        with self._lock:
            proc = self._procs.get(run_dir)
        if proc is not None:
            self._pool.submit(proc.kill)  # its waiter then writes `failed` (killed on request) if nothing else did
        else:
            self._pool.submit(kill_run, run_dir)

    def delete(self, name: str) -> None:
        run_dir = self.run_dir(name)
        if read_run(run_dir).active:
            raise UserError(f"Run {name} is still running: stop it first, then delete it.")
        shutil.rmtree(run_dir)

    def shutdown(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
