"""Who may reach the UI, and which paths may be typed into it.

- Serving on a non-loopback address (or through a public share link) without a login is refused, unless the
  user says `--insecure`: anyone who reaches the port could start jobs and read files on the machine.
- The login may come from `--auth user:password` or, for containers, the IMAGETUNE_AUTH environment variable.
- When the UI is exposed, every path typed into it (model, data, class images, dataset check) must lie inside
  the workspace root (IMAGETUNE_WORKSPACE, default: the current folder); hub ids and `demo://` assets are not paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainer.core.config.validate import DEMO_SCHEME, is_hub_id
from trainer.errors import UserError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
AUTH_ENV = "IMAGETUNE_AUTH"
WORKSPACE_ENV = "IMAGETUNE_WORKSPACE"
# The config keys that name files or folders on this machine.
PATH_KEYS = ("model.path", "model.config", "data.path", "prior.class_path")


def parse_auth(text: str, source: str = "--auth") -> tuple[str, str]:
    user, sep, password = (text or "").partition(":")
    if not (sep and user and password):
        raise UserError(f"{source} must look like user:password (both non-empty).")
    return user, password


def auth_from_env(auth: tuple[str, str] | None, environ=os.environ) -> tuple[str, str] | None:
    """The login passed in, else the one in IMAGETUNE_AUTH (user:password), else None."""
    if auth:
        return auth
    text = environ.get(AUTH_ENV, "").strip()
    return parse_auth(text, AUTH_ENV) if text else None


def is_exposed(host: str, share: bool) -> bool:
    return bool(share) or host not in LOCAL_HOSTS


def check_exposure(host: str, share: bool, auth, insecure: bool) -> None:
    """Refuse to serve beyond this machine without a login (unless --insecure)."""
    if is_exposed(host, share) and not auth and not insecure:
        where = "a public share link" if share else f"{host} (reachable from other machines)"
        raise UserError(
            f"Refusing to serve the UI on {where} without a login: anyone who reaches it could start jobs and "
            f"read files on this machine. Add --auth user:password (or set {AUTH_ENV}=user:password), or pass "
            "--insecure if the network is trusted. On this machine only, use the default --host 127.0.0.1."
        )


@dataclass(frozen=True)
class Workspace:
    """Paths typed into the UI resolve under `root`; when `confined`, nothing outside it is accepted."""

    root: Path
    confined: bool = False

    @classmethod
    def for_server(cls, host: str, share: bool, root: str | Path | None = None, environ=os.environ) -> Workspace:
        base = root or environ.get(WORKSPACE_ENV) or Path.cwd()
        return cls(Path(base).expanduser().resolve(), confined=is_exposed(host, share))

    def resolve(self, text: str) -> Path:
        """The absolute path `text` names (relative paths are taken from the current folder, like the CLI)."""
        return Path(os.path.abspath(Path(text).expanduser()))

    def contains(self, path: str | Path) -> bool:
        resolved = Path(os.path.realpath(self.resolve(str(path))))
        root = Path(os.path.realpath(self.root))
        return resolved == root or root in resolved.parents

    def problem(self, key: str, text) -> str | None:
        """`"key: message"` when `text` is a local path outside the workspace (and the UI is exposed), else None."""
        if not self.confined or not isinstance(text, str) or not text.strip():
            return None
        if text.startswith(DEMO_SCHEME) or is_hub_id(text):
            return None
        if self.contains(text):
            return None
        return (f"{key}: '{text}' is outside the workspace {self.root}; this UI is reachable from other machines, "
                f"so it only uses files under that folder")

    def check(self, key: str, text: str) -> Path:
        """`resolve(text)`, or a UserError when confinement forbids it."""
        problem = self.problem(key, text)
        if problem:
            raise UserError(problem)
        return self.resolve(text)

    def config_problems(self, values: dict) -> list[str]:
        return [p for key in PATH_KEYS if (p := self.problem(key, values.get(key)))]
