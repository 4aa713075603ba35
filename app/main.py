"""Serve the web UI: `python launch.py` (see launch.py for the options) calls `main`.

    main(host="127.0.0.1", port=7860, auth=None, share=False, insecure=False, runs_dir="runs", allowed_origins=())

Refuses to serve beyond this machine without a login or with a short password (app.security); every request
passes app.guard first (origin, Host, login back-off, SameSite cookie). Environment variables, for containers:
IMAGETUNE_AUTH (user:password, when no auth is passed), IMAGETUNE_HOME (user presets: $IMAGETUNE_HOME/presets),
IMAGETUNE_WORKSPACE (the folder typed paths are confined to when the UI is exposed), IMAGETUNE_ALLOWED_ORIGINS
(comma-separated origins besides the UI's own, e.g. a proxy's).
This module imports gradio but never torch; GPUs are probed in a child process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # nothing phones home

from app.security import Workspace, auth_from_env, check_exposure, login_for
from trainer.core.data.confine import set_confinement
from trainer.errors import UserError

MAX_UPLOAD = "20mb"  # nothing in the UI takes uploads; a limit keeps Gradio's upload route from filling the disk


def _patient_url_ok() -> None:
    """Gradio checks that it can reach itself once, with a 3 s timeout, and refuses to start otherwise; on a
    busy machine (training on every core) that first answer can take longer. Retry for up to a minute."""
    import time

    from gradio import networking

    original = networking.url_ok
    if getattr(original, "_patient", False):
        return

    def url_ok(url: str) -> bool:
        deadline = time.monotonic() + 60
        while not original(url):
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    url_ok._patient = True  # type: ignore[attr-defined]  # the marker that keeps a second call from wrapping it again
    networking.url_ok = url_ok


UI_NICE = 10  # how much lower than the runs the page-serving threads run (nice(2) steps)


def lower_priority() -> None:
    """The threads made from here on (Gradio's server and its handlers) run UI_NICE steps below the runs, so
    polling pages do not slow training on shared cores. On Linux a priority is each thread's own and a new thread
    or process inherits its creator's: runs start from app.jobs' launcher thread, made earlier, and keep the
    priority the UI started with. Elsewhere (macOS, Windows) the priority is the whole process's and runs would
    inherit the lower one, so nothing changes there."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.nice(UI_NICE)
    except OSError:
        pass  # not permitted here: the UI keeps its priority


def check_runs_dir(runs_dir: str | Path, workspace_root: Path) -> None:
    """Gradio serves every file under the runs folder to whoever is logged in: never a whole disk or home."""
    path = Path(runs_dir).expanduser().resolve()
    forbidden = {Path("/"): "the root folder", Path.home().resolve(): "your home folder",
                 workspace_root.resolve(): "the workspace root"}
    if path in forbidden:
        raise UserError(f"--runs-dir {runs_dir} is {forbidden[path]}: the UI serves every file in the runs folder, "
                        "so it must be a folder of its own, e.g. --runs-dir runs (or <workspace>/runs).")


def main(host: str = "127.0.0.1", port: int = 7860, auth: tuple[str, str] | None = None, share: bool = False,
         insecure: bool = False, runs_dir: str | Path = "runs", home: str | Path | None = None,
         workspace: str | Path | None = None, inbrowser: bool = False, allowed_origins=(), clock=None) -> int:
    auth = login_for(host, share, auth_from_env(auth), insecure, say=lambda text: print(text, file=sys.stderr,
                                                                                         flush=True))
    os.environ.pop("IMAGETUNE_AUTH", None)  # runs started from the UI inherit its environment; not the password
    check_exposure(host, share, auth, insecure)
    ws = Workspace.for_server(host, share, workspace, runs_dir=runs_dir)
    check_runs_dir(runs_dir, ws.root)
    if ws.confined:
        # Dataset scans (the Dataset check here, the workers of the runs started from here) skip every file whose
        # symlinks lead out of these folders: confining data.path alone let a linked sub-folder be read.
        set_confinement([ws.root, runs_dir])
    from app import guard

    policy = guard.OriginPolicy.build(host, allowed_origins)
    guard.install(policy, guard.LoginThrottle(clock) if clock else guard.LoginThrottle(), guard.trusted_proxies())
    from app.ui import CSS_PATH, THEME, build_ui, make_context

    ctx = make_context(runs_dir, home, ws)
    ctx.login = auth is not None
    ctx.jobs.start_queue_runner()  # queued runs start here too, as their devices come free (trainer.core.queue)
    ctx.jobs.warm_demo()  # builds the offline demo's tiny model in a child process, so the first Start is quick
    blocks = build_ui(ctx)
    _patient_url_ok()
    lower_priority()  # after the queue runner and the launcher thread exist: they keep the runs' priority
    blocks.queue(default_concurrency_limit=4)
    print(f"imagetune UI: runs in {ctx.runs_dir}, your presets in {ctx.presets.user_dir}", flush=True)
    if ctx.workspace.confined:
        print(f"paths typed into the UI are confined to {ctx.workspace.root}", flush=True)
    try:
        blocks.launch(
            server_name=host, server_port=port, auth=auth, share=share, inbrowser=inbrowser,
            allowed_paths=[str(ctx.runs_dir)], show_error=True, max_file_size=MAX_UPLOAD, ssr_mode=False, theme=THEME,
            css_paths=[str(CSS_PATH)], footer_links=["gradio", "settings"],
            auth_message="imagetune: log in with the user and password set in IMAGETUNE_AUTH.",
        )
    finally:
        ctx.jobs.shutdown()
    print("UI closed. Runs it started keep going; `python launch.py` again follows them.", file=sys.stderr)
    return 0
