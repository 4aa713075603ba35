"""The New run tab's import: a kohya_ss / sd-scripts / ai-toolkit config uploaded from the browser -> a user
preset, through the same importer as `launch.py --import-kohya` / `--import-ai-toolkit` (trainer.core.importers).

The upload is a file Gradio stored in its own upload folder; what the importer reads beyond it (an sd-scripts
dataset_config, a prompt file, the image folders it counts) is confined to the workspace when the UI is exposed
(IMAGETUNE_CONFINE, trainer.core.data.confine). The preset is written into the user's presets folder under a name
checked like a saved preset's, never over an existing one. Torch-free and gradio-free.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from app.presets import _NAME, Presets
from app.security import Workspace
from trainer.core.importers import import_config
from trainer.errors import UserError

KIND_BY_SUFFIX = {".json": "kohya", ".toml": "kohya", ".yaml": "ai-toolkit", ".yml": "ai-toolkit"}
MAX_BYTES = 1 << 20  # a trainer's config is a few KB; anything larger is not one


@dataclass
class ImportReport:
    preset_id: str
    html: str


def import_upload(presets: Presets, workspace: Workspace, upload: str | None, name: str = "") -> ImportReport:
    if not upload:
        raise UserError("Choose the config file to import first (kohya_ss .json, sd-scripts .toml, ai-toolkit .yaml).")
    source = Path(upload)
    kind = KIND_BY_SUFFIX.get(source.suffix.lower())
    if kind is None or not source.is_file():
        raise UserError(f"{source.name}: import a kohya_ss GUI .json, an sd-scripts .toml or an ai-toolkit job .yaml.")
    if source.stat().st_size > MAX_BYTES:
        raise UserError(f"{source.name} is over 1 MB: that is not a trainer's config file.")
    name = (name or "").strip().removesuffix(".yaml") or source.stem.replace(" ", "-")
    if not _NAME.fullmatch(name):
        raise UserError("A preset name uses letters, digits, '.', '_' and '-' (starting with a letter or digit), "
                        "for example my-dog-lora.")
    target = presets.user_dir / f"{name}.yaml"
    if target.exists():
        raise UserError(f"A preset named {name} exists already; give the import another name.")
    result = import_config(kind, source, target)
    problems = list(result.problems)
    if workspace.confined:  # the run would be refused at Start; say so now, at the key to change
        values = _flat(result.imported.preset)
        problems += workspace.config_problems(values)
    return ImportReport(f"user/{name}", _report(name, result, problems))


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _report(name: str, result, problems: list[str]) -> str:
    def items(lines) -> str:
        return "".join(f"<li>{html.escape(line)}</li>" for line in lines)

    parts = [f'<div class="msg-box {"warning" if problems else "ok"}"><b>Imported as the preset '
             f'{html.escape(name)}</b> (pick it in the preset list).']
    if result.imported.notes:
        parts.append(f"<p>Choices made:</p><ul>{items(result.imported.notes)}</ul>")
    if result.imported.unmapped:
        parts.append(f"<p>Not imported ({len(result.imported.unmapped)}):</p>"
                     f"<ul>{items(f'{key}: {why}' for key, why in result.imported.unmapped)}</ul>")
    if problems:
        parts.append(f"<p>Still to set before it runs:</p><ul>{items(problems)}</ul>")
    return "".join(parts) + "</div>"
