"""What polling web UI sessions cost a training run on a small machine: training steps/s of the offline demo with 0
and with N sessions polling the Runs tab every 2 s, in one run (the phases alternate, so a shared machine's drift
does not favour one), and the same with the training's OpenMP threads spinning (OMP_WAIT_POLICY=ACTIVE) or sleeping (PASSIVE,
what the launcher now sets for CPU runs) while they wait.

    python bench/ui_load.py                          # 20 sessions, 30 s phases, 2 rounds
    python bench/ui_load.py --sessions 20 --phase-s 30 --rounds 2 --json bench/results/ui_load.json
    python bench/ui_load.py --http --sessions 20 --phase-s 15 --rounds 6   # the real server, over HTTP

With --http the UI is the real server (`launch.py --host 127.0.0.1 --port P`, its own process) and each session
is an open page as the server sees it (bench/_gradio_page.py: the requests Chromium sends while the Runs tab is
shown, recorded with Playwright); the UI's cost is then that whole process's CPU time, HTTP and Gradio included.

A session is what the server does for one open page: the Runs tab's timer calls `app.ui_runs.tick` with that
page's `seen` (what it shows) every 2 s, each session on its own thread, all in one process (the UI's), as
Gradio's handlers run. HTTP and the browser's drawing are not in it: this is the server's share, the part that
competes with training for the same cores. Steps/s are read from the run's own `progress` events; the UI's
cost is this process's CPU time over each phase (a share of one core), and the training's its worker's CPU
seconds per step (/proc): both counted in CPU time, which other tenants of a shared machine disturb far less than
the wall-clock rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_training(runs: Path, passive: bool) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "IMAGETUNE_FAULT"}
    # The launcher sets PASSIVE for CPU runs now (trainer.core.launcher.build_env); ACTIVE spins as they did.
    env["OMP_WAIT_POLICY"] = "PASSIVE" if passive else "ACTIVE"
    name = f"load-{'passive' if passive else 'spin'}"
    subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--preset", "demo", "--runs-dir", str(runs),
                      f"name={name}", "train.steps=1000000", "sample.every=0", "checkpoint.every=0", "devices=cpu:1"],
                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = runs / name
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if _steps(run):
            return run
        time.sleep(1)
    raise SystemExit(f"the demo run did not step within 10 minutes; see {run}/train.log")


def _steps(run: Path) -> list[tuple[float, int]]:
    out = []
    try:
        for line in (run / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("type") == "progress":
                out.append((event["time"], event["step"]))
    except (OSError, ValueError):
        pass
    return out


def worker_cpu_s(run: Path) -> float:
    """CPU seconds (user + system) of the run's processes so far: its launcher pid and every descendant."""
    from trainer.core.runfolder import RunFolder

    pid = RunFolder(run).launcher_pid()
    return 0.0 if pid is None else tree_cpu_s(pid)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and every descendant so far (/proc)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    children = {pid}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid = int(fields[1])
        if int(stat.parent.name) == pid or ppid in children:
            children.add(int(stat.parent.name))
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rate(run: Path, start: float, end: float) -> float:
    inside = [(t, s) for t, s in _steps(run) if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def poll(runs: Path, name: str, sessions: int, seconds: float) -> int:
    """`sessions` pages polling run `name` for `seconds`; how many polls rendered something."""
    from app import ui_runs
    from app.jobs import HardwareCache, Jobs
    from trainer.core.hardware import Hardware

    ctx = type("Ctx", (), {"jobs": Jobs(runs, HardwareCache(hw=Hardware(cpu_count=os.cpu_count() or 1)))})()
    stop = time.monotonic() + seconds
    rendered = [0]

    def page(offset: float) -> None:
        seen: dict = {}
        time.sleep(offset)  # pages opened at different moments, as people do
        while time.monotonic() < stop:
            out = ui_runs.tick(ctx, name, seen)
            if isinstance(out[-1], dict) and "fingerprint" in out[-1]:  # rendered (else gr.skip())
                seen = out[-1]
                rendered[0] += 1
            time.sleep(ui_runs.POLL_S)

    threads = [threading.Thread(target=page, args=(2.0 * i / max(1, sessions),)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rendered[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--omp", choices=("both", "active", "passive"), default="both",
                   help="the training's OMP_WAIT_POLICY: ACTIVE (threads spin), PASSIVE (they sleep), or both runs")
    p.add_argument("--http", action="store_true",
                   help="poll a real UI server (launch.py) over HTTP as open pages do (bench/_gradio_page.py), "
                        "and count that whole process's CPU; the training's threads sleep (the launcher's default)")
    p.add_argument("--fresh-s", type=float, default=None,
                   help="app.ui_runs.SHARED.fresh_s (0: every poll of a changed folder renders anew, as before "
                        "the shared renders)")
    args = p.parse_args()
    if args.http:
        return main_http(args)
    if args.fresh_s is not None:
        from app import ui_runs

        ui_runs.SHARED.fresh_s = args.fresh_s
    results: dict = {"cores": len(os.sched_getaffinity(0)), "sessions": args.sessions, "phase_s": args.phase_s,
                     "fresh_s": args.fresh_s, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        for passive in {"both": (False, True), "active": (False,), "passive": (True,)}[args.omp]:
            run = start_training(runs, passive)
            time.sleep(5)  # past the first steps' warm-up
            rates: dict[str, list[float]] = {"0": [], str(args.sessions): []}
            cpu_per_step: dict[str, list[float]] = {"0": [], str(args.sessions): []}
            ui_share: list[float] = []
            for _ in range(args.rounds):
                for sessions in (0, args.sessions):
                    start, ui0, train0 = time.time(), time.process_time(), worker_cpu_s(run)
                    steps0 = (_steps(run) or [(0, 0)])[-1][1]
                    if sessions:
                        poll(runs, run.name, sessions, args.phase_s)
                        ui_share.append((time.process_time() - ui0) / (time.time() - start))
                    else:
                        time.sleep(args.phase_s)
                    rates[str(sessions)].append(rate(run, start, time.time()))
                    steps = (_steps(run) or [(0, 0)])[-1][1] - steps0
                    cpu_per_step[str(sessions)].append((worker_cpu_s(run) - train0) / steps if steps else 0.0)
            (run / "STOP").write_text("")
            key = "omp_passive" if passive else "omp_active"
            med = {k: statistics.median(v) for k, v in rates.items()}
            results[key] = {"steps_per_s": rates, "median": med,
                            "slowdown": 1 - med[str(args.sessions)] / med["0"] if med["0"] else None,
                            "train_cpu_s_per_step": {k: statistics.median(v) for k, v in cpu_per_step.items()},
                            "ui_cpu_share_of_a_core": statistics.median(ui_share) if ui_share else None}
            print(json.dumps({key: results[key]}), flush=True)
            _wait_stopped(run)
    return _write(results, args)


def _wait_stopped(run: Path, timeout_s: float = 120) -> None:
    """Until the training stopped by its STOP file has written `stopped` (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any('"stopped"' in line for line in
                                                  (run / "events.jsonl").read_text().splitlines()[-3:]):
        time.sleep(1)


def _write(results: dict, args, shown=lambda r: r) -> int:
    """The load after the runs, the JSON file (--json) and what is printed."""
    results["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(shown(results), indent=2))
    return 0


def main_http(args) -> int:
    """The UI as users run it: `launch.py --host 127.0.0.1 --port P` in its own process, N pages polling it over
    HTTP (bench/_gradio_page.py, threads of this process, paused in the 0-session phases), the training started
    headless into the same runs folder (so the UI shows it). The UI's cost: its process tree's CPU time (/proc)."""
    import socket
    import urllib.request

    from bench._gradio_page import Page, timer_handlers

    results: dict = {"mode": "http", "cores": len(os.sched_getaffinity(0)), "sessions": args.sessions,
                     "phase_s": args.phase_s, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        runs = Path(tmp) / "runs"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {**os.environ, "IMAGETUNE_HOME": str(Path(tmp) / "home"), "GRADIO_ANALYTICS_ENABLED": "False",
               "HF_HUB_OFFLINE": "1"}
        env.pop("IMAGETUNE_AUTH", None)
        ui = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--host", "127.0.0.1", "--port", str(port),
                               "--runs-dir", str(runs)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(url, timeout=2).close()
                    break
                except OSError:
                    time.sleep(0.5)  # a poll of a starting server
            run = start_training(runs, passive=True)
            handlers = timer_handlers(url)
            active, stop = threading.Event(), threading.Event()
            pages = [Page(url, handlers, active, stop, 2.0 * i / max(1, args.sessions))
                     for i in range(args.sessions)]
            for page in pages:
                page.start()
            for page in pages:
                page.opened.wait(300)  # every page open (its first render is not a poll's cost)
            time.sleep(5)  # past the first steps' warm-up
            phases: list[dict] = []
            for _ in range(args.rounds):
                for sessions in (0, args.sessions):
                    (active.set if sessions else active.clear)()
                    for page in pages if not sessions else []:
                        page.idle.wait(120)  # the last phase's requests answered: none counts in this one
                    start, ui0, me0, train0 = time.time(), tree_cpu_s(ui.pid), time.process_time(), worker_cpu_s(run)
                    steps0 = (_steps(run) or [(0, 0)])[-1][1]
                    requests0 = sum(p.requests for p in pages)
                    time.sleep(args.phase_s)
                    wall = time.time() - start
                    steps = (_steps(run) or [(0, 0)])[-1][1] - steps0
                    phases.append({"sessions": sessions, "steps_per_s": rate(run, start, time.time()),
                                   "ui_share": (tree_cpu_s(ui.pid) - ui0) / wall,
                                   "clients_share": (time.process_time() - me0) / wall,
                                   "train_cpu_s_per_step": (worker_cpu_s(run) - train0) / steps if steps else None,
                                   "requests_per_s": (sum(p.requests for p in pages) - requests0) / wall,
                                   "load": os.getloadavg()[0]})
                    print(json.dumps(phases[-1]), flush=True)
            errors = sum(p.errors for p in pages)  # before the pages stop (then the server goes away)
            stop.set()
            active.set()
            (run / "STOP").write_text("")
        finally:
            ui.terminate()
            ui.wait(30)
        results["phases"] = phases
        results["requests"] = sum(p.requests for p in pages)
        results["errors"] = errors
        results["last_errors"] = sorted({p.last_error for p in pages if p.last_error})[:5]
        results["pages_on_the_run"] = sum(p.values.get(p.select_id) == run.name for p in pages)
        for n in (0, args.sessions):
            mine = [ph for ph in phases if ph["sessions"] == n]
            results[f"median_{n}"] = {k: statistics.median(ph[k] for ph in mine if ph[k] is not None)
                                      for k in ("steps_per_s", "ui_share", "clients_share", "train_cpu_s_per_step",
                                                "requests_per_s", "load")}
        m0, mn = results["median_0"]["steps_per_s"], results[f"median_{args.sessions}"]["steps_per_s"]
        results["slowdown"] = 1 - mn / m0 if m0 else None
        _wait_stopped(run)
    return _write(results, args, shown=lambda r: {k: v for k, v in r.items() if k != "phases"})


if __name__ == "__main__":
    sys.exit(main())
