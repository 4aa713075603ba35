"""Who may reach the UI, and which paths may be typed into it.

- Serving on a non-loopback address (or through a public share link) without a login is refused, unless the
  user says `--insecure`: anyone who reaches the port could start jobs and read files on the machine.
- The login may come from `--auth user:password` or, for containers, the IMAGETUNE_AUTH environment variable.
- When the UI is exposed, every path a run would read or write must lie inside the workspace root
  (IMAGETUNE_WORKSPACE, default: the current folder), checked on the built config (after overrides, symlinks
  followed) and on what a dataset descriptor (YOLO data.yaml, COCO json) points to; `demo://` assets and, in the
  model keys only, hub ids are not paths. A path that does not exist yet is resolved and checked all the same, and
  the shipped demo assets' resolved paths (a demo run's config.yaml) are trusted by name where a run only reads.
  The files inside a dataset are confined by trainer.core.data.confine (IMAGETUNE_CONFINE, set by app.main). Multi-node (a torchrun that connects to a user-chosen address) is refused; it stays a CLI feature.
- An exposed login needs a password of at least MIN_PASSWORD characters (unless --insecure).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from trainer.core.assets import demo_asset_name
from trainer.core.config.validate import DEMO_SCHEME, hub_id_at
from trainer.errors import UserError
from trainer.families import SPECS
from trainer.core.family_spec import load_object

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MIN_PASSWORD = 12
AUTH_ENV = "IMAGETUNE_AUTH"
WORKSPACE_ENV = "IMAGETUNE_WORKSPACE"
# The config keys that name files or folders on this machine, in any family (each family's spec says which are
# paths for it: for detection, model.path names an architecture).
PATH_KEYS = tuple(dict.fromkeys(key for spec in SPECS.values() for key in spec.path_keys))
WRITTEN_KEYS = ("prior.class_path",)  # path keys a run writes into: a demo asset is never trusted there


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


GENERATED_USER = "imagetune"


def login_for(host: str, share: bool, auth, insecure: bool, say=print):
    """The login the UI will require: the one given; else, when the UI is reachable from other machines (and
    not --insecure), one made up for this start and said once (`say`), so an exposed UI never runs open and a
    first start on a cloud box still works."""
    if auth or insecure or not is_exposed(host, share):
        return auth
    password = secrets.token_urlsafe(18)  # 24 characters, 144 bits
    say(f"No login was given for a UI reachable from other machines, so this start made one: user "
        f"{GENERATED_USER}, password {password} (shown only here; set {AUTH_ENV}=user:password to choose your "
        "own).")
    return (GENERATED_USER, password)


def check_exposure(host: str, share: bool, auth, insecure: bool) -> None:
    """Refuse to serve beyond this machine without a login, or with a guessable password (unless --insecure)."""
    if is_exposed(host, share) and auth and len(auth[1]) < MIN_PASSWORD and not insecure:
        raise UserError(
            f"The password is {len(auth[1])} characters long; a UI reachable from other machines needs at least "
            f"{MIN_PASSWORD}, or it can be guessed. Set a longer one in {AUTH_ENV}=user:password (for example "
            "from `python -c 'import secrets; print(secrets.token_urlsafe(16))'`), or pass --insecure if the "
            "network is trusted.")
    if is_exposed(host, share) and not auth and not insecure:
        where = "a public share link" if share else f"{host} (reachable from other machines)"
        raise UserError(
            f"Refusing to serve the UI on {where} without a login: anyone who reaches it could start jobs and "
            f"read files on this machine. Set {AUTH_ENV}=user:password in the environment (--auth user:password "
            "works too, but puts the password where ps shows it), or pass "
            "--insecure if the network is trusted. On this machine only, use the default --host 127.0.0.1."
        )


@dataclass(frozen=True)
class Workspace:
    """Paths typed into the UI resolve under `root`; when `confined`, nothing outside it is accepted."""

    root: Path
    confined: bool = False
    runs_dir: Path | None = None  # where the demo assets are built (.demo/), trusted by name like the shipped ones

    @classmethod
    def for_server(cls, host: str, share: bool, root: str | Path | None = None, environ=os.environ,
                   runs_dir: str | Path | None = None) -> Workspace:
        base = root or environ.get(WORKSPACE_ENV) or Path.cwd()
        runs = Path(runs_dir).expanduser().resolve() if runs_dir is not None else None
        return cls(Path(base).expanduser().resolve(), confined=is_exposed(host, share), runs_dir=runs)

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
        if text.startswith(DEMO_SCHEME) or hub_id_at(key, text):
            return None  # only a model key may name a hub id; every other path is resolved and confined
        if self.contains(text):
            return None
        if key not in WRITTEN_KEYS and demo_asset_name(self.resolve(text), self.runs_dir):
            return None  # a shipped demo asset (a demo run's config.yaml holds its resolved path): read, never written
        return (f"{key}: '{text}' is outside the workspace {self.root}; this UI is reachable from other machines, "
                f"so it only uses files under that folder")

    def check(self, key: str, text: str) -> Path:
        """`resolve(text)`, or a UserError when confinement forbids it."""
        problem = self.problem(key, text)
        if problem:
            raise UserError(problem)
        return self.resolve(text)

    def config_problems(self, values: dict) -> list[str]:
        """Problems of the form's raw values (so they are marked at their field even when the config does not
        build); `built_problems` checks what a run would really use."""
        family = values.get("model.family")
        problems = [p for key in PATH_KEYS if (p := self.problem(key, _path_value(key, values.get(key), family)))]
        return problems + [p for key, text in dataset_entry_paths(values.get("data.datasets"))
                           if (p := self.problem(key, text))]

    def built_problems(self, config) -> list[str]:
        """Everything an exposed UI refuses in a built Config: paths outside the workspace (its path keys and the
        files a dataset descriptor names) and multi-node settings."""
        if not self.confined:
            return []
        values = {key: _select(config, key) for key in (*PATH_KEYS, "data.datasets")}
        problems = self.config_problems({**values, "model.family": config.model.family})
        spec = SPECS.get(config.model.family)
        if not problems and spec is not None and spec.dataset_paths:
            for key, text in load_object(spec.dataset_paths)(config):
                if (p := self.problem(key, text)):
                    problems.append(p)
                    break  # one is enough to refuse; a big dataset could list thousands
        return problems + multinode_problems(config) + upload_problems(config)

    def approve(self, config) -> None:
        """Raise UserError when an exposed UI must not run `config` (see built_problems)."""
        problems = self.built_problems(config)
        if problems:
            raise UserError("Refused: " + "; ".join(problems) + ".")


def dataset_entry_paths(entries) -> list[tuple[str, str]]:
    """(key, path) of each data.datasets entry: mappings as the form holds them, or the built DatasetEntry objects.
    Anything else (text the YAML could not parse) names no path; the engine reports it."""
    out = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        path = entry.get("path") if isinstance(entry, dict) else getattr(entry, "path", None)
        if isinstance(path, str):
            out.append((f"data.datasets[{i}].path", path))
    return out


def _select(config, key: str):
    obj = config
    for part in key.split("."):
        obj = getattr(obj, part, None)
    return obj


def _path_value(key: str, value, family):
    """`value` when it names a path for `family` (any family's reading when the family is not known yet)."""
    spec = SPECS.get(family)
    if spec is not None:
        return value if spec.is_path(key, value) else None
    if any(value in s.path_exceptions.get(key, ()) for s in SPECS.values()):
        return None
    return value


def multinode_problems(config) -> list[str]:
    """Multi-node makes torchrun connect to distributed.master_addr and exchange objects with it: from a UI anyone
    can reach, that is a way to make this machine talk to a host of the visitor's choosing. It stays a CLI feature."""
    d = config.distributed
    problems = []
    if d.nodes > 1:
        problems.append(f"distributed.nodes: {d.nodes} machines is a command-line feature (python launch.py "
                        "--preset ... distributed.nodes=N on every machine); this UI is reachable from other "
                        "machines, so it trains on this machine only (nodes: 1)")
    if str(d.master_addr).strip() not in ("127.0.0.1", "localhost", "::1"):
        problems.append(f"distributed.master_addr: {d.master_addr!r} is not this machine; this UI only trains "
                        "on this machine (127.0.0.1)")
    return problems


def upload_problems(config) -> list[str]:
    """output.push_to_hub and logging.wandb send the run's files and numbers out with this machine's own tokens
    (HF_TOKEN, WANDB_API_KEY), to a repo or project the form names: from a UI anyone can reach, a visitor could
    publish into the owner's repos. They stay command-line features there (TensorBoard writes locally: allowed)."""
    problems = []
    if getattr(config.output, "push_to_hub", None):
        problems.append("output.push_to_hub: uploading with this machine's Hugging Face token is a command-line "
                        "feature when the UI is reachable from other machines (python launch.py --preset ... "
                        "output.push_to_hub=user/name)")
    if getattr(config.logging, "wandb", None):
        problems.append("logging.wandb: logging with this machine's W&B key is a command-line feature when the UI "
                        "is reachable from other machines; logging.tensorboard works here")
    return problems
