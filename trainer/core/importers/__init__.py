"""Bring your config: another trainer's config file -> an imagetune preset (`launch.py --import-kohya FILE`,
`--import-ai-toolkit JOB.yaml`). Torch-free. Each importer returns an `Imported` (common.py): the sparse preset,
the keys it could not map and why, and the choices it made; `import_config` validates the preset as `--dry-run`
would and writes it with all of that as comments at its top."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.core.importers.common import Imported, render
from trainer.errors import ConfigError, UserError

KINDS = ("kohya", "ai-toolkit")


@dataclass
class ImportResult:
    out: Path
    imported: Imported
    problems: list[str]  # what the user must still set: load_config's problems with the written preset


def read(kind: str, path: Path) -> Imported:
    if kind == "kohya":
        from trainer.core.importers.kohya import read_kohya

        return read_kohya(path)
    if kind == "ai-toolkit":
        from trainer.core.importers.ai_toolkit import read_ai_toolkit

        return read_ai_toolkit(path)
    raise ValueError(f"unknown importer {kind!r}")


def default_out(path: Path) -> Path:
    return Path(f"{path.stem}.imagetune.yaml")


def import_config(kind: str, path: str | Path, out: str | Path | None = None) -> ImportResult:
    """Read `path`, write the preset to `out` (default: `<name>.imagetune.yaml` here, never over an existing file),
    and say whether it loads as `--preset` would load it (paths checked)."""
    from trainer.core.config.load import load_config
    from trainer.core.config.schema import SCHEMA_VERSION

    source = Path(path)
    if not source.is_file():
        raise UserError(f"--import-{kind}: {source} is not a file. Give the path of the config to import.")
    target = Path(out) if out else default_out(source)
    if out is None and target.exists():
        raise UserError(f"--import-{kind}: {target} already exists; choose where to write with --out P.yaml.")
    if target.suffix.lower() not in (".yaml", ".yml"):
        raise UserError(f"--out: {target} must be a .yaml file (a preset).")
    imported = read(kind, source)
    imported.preset = {"version": SCHEMA_VERSION, **imported.preset}
    problems: list[str] = []
    try:
        config = load_config(imported.preset)
    except ConfigError as exc:
        problems = exc.problems
    except UserError as exc:
        problems = [str(exc)]
    else:
        problems = _machine_problems(config)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(imported, problems, f"launch.py --import-{kind} {source.name}"), encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--out: cannot write {target} ({exc.strerror or exc}).") from None
    return ImportResult(out=target, imported=imported, problems=problems)


def _machine_problems(config) -> list[str]:
    """What --dry-run would also refuse on this machine (its GPUs: adamw8bit needs bitsandbytes on CUDA...)."""
    from trainer.core.launcher import plan_for

    try:
        plan_for(config)
    except ConfigError as exc:
        return [f"on this machine: {problem}" for problem in exc.problems]
    except UserError as exc:
        return [f"on this machine: {exc}"]
    return []
