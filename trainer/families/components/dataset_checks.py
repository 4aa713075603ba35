"""Config checks of the image folders (torch-free): `data.path`, or the entries of `data.datasets`
(trainer.core.config.datasets), each resolved against the data.* defaults (trainer.core.data.sources)."""

from __future__ import annotations

from pathlib import Path

from trainer.core.config.validate import DEMO_SCHEME
from trainer.core.data.sources import sources


def _folder_problem(key: str, path: str) -> str | None:
    if not path:
        return f"{key}: is empty; set it to a folder of training images"
    if not path.startswith(DEMO_SCHEME) and not Path(path).expanduser().is_dir():
        return f"{key}: folder '{path}' does not exist; point it at a folder of images"
    return None


def dataset_problems(config, *, check_paths: bool = True) -> list[str]:
    from trainer.families import SPECS  # the registry imports the families' specs, which import these checks

    spec = SPECS.get(config.model.family)
    resolution_multiple = 8  # an unknown family (reported elsewhere): the VAEs' downsampling
    if spec is not None:
        resolution_multiple = (spec.bucket_multiple if config.data.bucketing else 0) or spec.resolution_multiple or 8
    data, p = config.data, []
    if not data.datasets:
        problem = _folder_problem("data.path", data.path) if check_paths else None
        return [problem] if problem else []
    if data.path:
        p.append("data.path: set together with data.datasets; use one: data.path for one folder, or add "
                 f"{{path: {data.path}}} to data.datasets and leave data.path empty")
    for i, (entry, source) in enumerate(zip(data.datasets, sources(data))):
        at = f"data.datasets[{i}]"
        if check_paths and (problem := _folder_problem(f"{at}.path", entry.path)):
            p.append(problem)
        if entry.repeats < 1:
            p.append(f"{at}.repeats: must be 1 or more (how often its images appear per epoch), got {entry.repeats}")
        if source.resolution < resolution_multiple or source.resolution % resolution_multiple:
            p.append(f"{at}.resolution: must be a multiple of {resolution_multiple}, got {source.resolution}")
        if not 0 <= source.augment.dropout < 1:
            p.append(f"{at}.caption_dropout: must be a probability in [0, 1), got {source.augment.dropout}")
        if source.augment.keep_tokens < 0:
            p.append(f"{at}.keep_tokens: must be 0 or more, got {source.augment.keep_tokens}")
    regularization = [s for s in sources(data) if s.regularization]
    if regularization and len(regularization) == len(data.datasets):
        p.append("data.datasets: every entry is is_regularization; at least one folder must hold the images to "
                 "train on (is_regularization: false)")
    if regularization and config.prior.enabled:
        p.append("prior.enabled: generates class images, while data.datasets has regularization folders for the "
                 "same purpose; use one: prior.enabled=false to train with your folders, or drop is_regularization")
    if len({s.resolution for s in regularization}) > 1:
        p.append("data.datasets: the regularization folders have different resolutions ("
                 + ", ".join(str(s.resolution) for s in regularization) + "); they train as square images of one "
                 "size, paired with every step: give them one resolution")
    return p


def control_path_problems(config, family: str, *, check_paths: bool = True) -> list[str]:
    """An edit family trains pairs: data.control_path must name a folder of control images."""
    folder = config.data.control_path
    if not folder:
        return [f"data.control_path: {family} trains instruction edits, each training image (the edit's result) "
                "with its control image (the source it was made from): set data.control_path to the folder of "
                "control images, named like the training images (ai-toolkit's control_path)"]
    if check_paths and not folder.startswith(DEMO_SCHEME) and not Path(folder).expanduser().is_dir():
        return [f"data.control_path: folder '{folder}' does not exist; point it at the folder of control images "
                "named like the training images"]
    return []
