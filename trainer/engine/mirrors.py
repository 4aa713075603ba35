"""TensorBoard and Weights & Biases (`logging.tensorboard`, `logging.wandb`): mirrors of the run's own event log.

Rank 0's `EventLog` is wrapped by `Mirrored`, so every event written to events.jsonl (progress, eval, sample...)
is also handed to each mirror, and the training loop knows nothing about them. A mirror that breaks (W&B's
service dies, a full disk) is dropped with one `warning` event: the run itself goes on.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

from trainer.core.events import FINAL_TYPES, Event, WarningEvent
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"  # the W&B run id, kept so that a resume continues the same W&B run


class Mirror(Protocol):
    name: str

    def write(self, event: dict) -> None: ...

    def close(self) -> None: ...


def _metrics(event: dict) -> dict[str, float]:
    """An eval event's numbers (step and time are where, not what)."""
    return {k: float(v) for k, v in event.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _as_code(text: str) -> str:
    """TensorBoard's text plugin renders markdown: indented, a YAML file keeps its lines and indentation."""
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardMirror:
    name = "TensorBoard"

    def __init__(self, run_dir: Path, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: after a resume from the checkpoint of step N, whatever an earlier launch logged past step N
        # (a killed run gets beyond its last checkpoint) is hidden, so the curves do not fold back on themselves;
        # step N itself was trained and logged for good.
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge, flush_secs=10)
        self.run_dir = run_dir

    def start(self, step: int, plan_line: str, config_yaml: str) -> None:
        self.writer.add_text("plan", plan_line, step)
        self.writer.add_text("config", _as_code(config_yaml), step)

    def write(self, event: dict) -> None:
        kind, step = event["type"], event.get("step")
        if kind == "progress":
            for name in ("loss", "lr"):
                if event.get(name) is not None:
                    self.writer.add_scalar(f"train/{name}", event[name], step)
        elif kind == "eval":
            for name, value in _metrics(event).items():
                self.writer.add_scalar(f"eval/{name}", value, step)
        elif kind == "sample":
            import numpy as np
            from PIL import Image

            with Image.open(self.run_dir / event["path"]) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image(f"samples/{event.get('index', 0):02d}", pixels, step, dataformats="HWC")
            self.writer.add_text(f"samples/{event.get('index', 0):02d}/prompt", str(event.get("prompt", "")), step)

    def close(self) -> None:
        self.writer.close()


class WandbMirror:
    name = "W&B"

    def __init__(self, run_dir: Path, target: str, run_name: str, config: dict):
        import wandb

        entity, _, project = target.rpartition("/")
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]  # W&B's own id form
        id_file.write_text(run_id)
        # resume="allow": the same id continues its W&B run after `--resume`, and starts it the first time
        try:
            self.run = wandb.init(project=project, entity=entity or None, id=run_id, resume="allow", name=run_name,
                                  dir=str(run_dir), config=config)
        except Exception as exc:  # no login, no network, a project W&B refuses: the user's to fix
            raise UserError(f"logging.wandb: W&B could not start a run in {target!r} ({type(exc).__name__}: {exc}). "
                            "Log in (`wandb login` or WANDB_API_KEY), set WANDB_MODE=offline to log without "
                            "network, or leave logging.wandb unset.") from None
        self.wandb = wandb
        self.run_dir = run_dir

    def start(self, step: int, plan_line: str, config_yaml: str) -> None:
        self.run.summary["plan"] = plan_line
        self.run.log({"plan": self.wandb.Html(f"<pre>{_escape(plan_line)}</pre>"),
                      "config": self.wandb.Html(f"<pre>{_escape(config_yaml)}</pre>")}, step=step)

    def write(self, event: dict) -> None:
        kind, step = event["type"], event.get("step")
        if kind == "progress":
            self.run.log({f"train/{k}": event[k] for k in ("loss", "lr") if event.get(k) is not None}, step=step)
        elif kind == "eval":
            self.run.log({f"eval/{k}": v for k, v in _metrics(event).items()}, step=step)
        elif kind == "sample":
            image = self.wandb.Image(str(self.run_dir / event["path"]), caption=str(event.get("prompt", "")))
            self.run.log({f"samples/{event.get('index', 0):02d}": image}, step=step)

    def close(self) -> None:
        self.run.finish()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Mirrored:
    """An EventLog whose events also go to mirrors; closes them at the run's final event (or `close()`)."""

    def __init__(self, log: Any, mirrors: list):
        self.log, self.mirrors = log, mirrors

    def emit(self, typed: Event) -> dict:
        event = self.log.emit(typed)
        for mirror in list(self.mirrors):
            try:
                mirror.write(event)
            except Exception as exc:  # a logging service must not end a training run
                self._drop(mirror, exc)
        if typed.kind in FINAL_TYPES:
            self.close()
        return event

    def _drop(self, mirror, exc: BaseException) -> None:
        self.mirrors.remove(mirror)
        self.log.emit(WarningEvent(message=f"{mirror.name} logging stopped ({type(exc).__name__}: {exc}); "
                                           "the run goes on, and events.jsonl has everything"))

    def close(self) -> None:
        mirrors, self.mirrors = self.mirrors, []
        for mirror in mirrors:
            try:
                mirror.close()
            except Exception as exc:
                self.log.emit(WarningEvent(message=f"{mirror.name} did not close cleanly ({type(exc).__name__}: {exc})"))


def open_mirrors(log: Any, config, run_dir: Path, step: int, resumed: bool) -> Any:
    """`log` wrapped with the mirrors `config.logging` asks for (rank 0 only), or `log` itself when none."""
    from trainer.core.config.load import to_dict, to_yaml
    from trainer.core.plan import Plan

    mirrors: list = []
    if config.logging.tensorboard:
        mirrors.append(TensorBoardMirror(run_dir, step if resumed else None))
    if config.logging.wandb:
        mirrors.append(WandbMirror(run_dir, config.logging.wandb, config.name, to_dict(config)))
    if not mirrors:
        return log
    plan_line = Plan.from_event(RunFolder(run_dir).read_plan()).line()
    for mirror in mirrors:
        mirror.start(step, plan_line, to_yaml(config))
    return Mirrored(log, mirrors)
