"""Which files a dataset scan may read when the UI is exposed: the scan follows symlinks, so a link inside the
workspace (a kohya sub-folder `10_x -> /outside`, a caption `a.txt -> /etc/...`, a mask) would otherwise read,
train on and show files the workspace check never saw (issue 29).

An exposed UI sets IMAGETUNE_CONFINE to its allowed folders (the workspace and the runs folder, os.pathsep
between them); the runs it starts inherit it, so their workers' scans skip the same files the UI's dataset check
skipped. Unset (the command line, a local UI) nothing is confined: a symlinked dataset is a normal thing to have.
Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFINE_ENV = "IMAGETUNE_CONFINE"


def confined_to(environ=os.environ) -> tuple[str, ...]:
    """The folders (symlinks resolved) every file a scan reads must lie in; empty when nothing is confined."""
    return tuple(os.path.realpath(p) for p in environ.get(CONFINE_ENV, "").split(os.pathsep) if p.strip())


def escapes(path: str | os.PathLike, roots: tuple[str, ...] | None = None) -> bool:
    """Whether `path`, after resolving every symlink on the way, lies outside the confined folders."""
    roots = confined_to() if roots is None else roots
    if not roots:
        return False
    real = os.path.realpath(path)
    return not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def set_confinement(folders, environ=os.environ) -> None:
    """Confine this process's scans (and, through the environment, the runs it starts) to `folders`."""
    environ[CONFINE_ENV] = os.pathsep.join(str(Path(f).expanduser().resolve()) for f in folders)


OUTSIDE = "links outside the workspace (this UI is reachable from other machines, so it reads files under it only)"
