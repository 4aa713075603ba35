"""One dataclass per kind of event in events.jsonl, shared by the writers (the workers, the launcher, an export)
and the readers (the web UI, launch.py): mypy checks both sides against the same fields.

Each class declares the fields some reader computes with, with their types; `extra` holds the rest (the plan's
figures, an evaluation's metrics, a failure's diagnosis), written as fields of the same JSON object, so the file
reads as it always did. `parse` turns a line of the file back into its class, checking every declared field's
type: a folder holding what no writer of ours writes raises `BadEvent` naming the field, and the reader shows that
run as unreadable instead of computing with a string where it expects a number.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath
from typing import Any, ClassVar, Union


class BadEvent(ValueError):
    """A line of events.jsonl whose fields do not have the types its kind declares."""


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = ""
    # Optional fields written even when None (readers of events.jsonl find the key, as they always did)
    always_written: ClassVar[tuple[str, ...]] = ()
    time: float = 0.0  # set when written (EventLog.emit)
    extra: dict[str, Any] = field(default_factory=dict)  # fields no reader types: written beside the declared ones

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.kind, "time": self.time}
        for f in fields(self):
            if f.name in ("time", "extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.default is None and f.name not in self.always_written:
                continue  # an optional figure this event does not have: left out, as the file always had it
            if isinstance(value, Event):  # nested (a resumed run's plan): its fields only
                value = {k: v for k, v in value.to_dict().items() if k not in ("type", "time")}
            data[f.name] = value
        data.update(self.extra)
        return data

    def check(self) -> None:
        """Checks beyond types (a path that must stay in the run folder)."""


@dataclass(frozen=True, kw_only=True)
class PlanEvent(Event):
    """A launch's plan (trainer.core.plan.Plan.event() in `extra`: world_size, devices, precision...)."""
    kind: ClassVar[str] = "plan"
    line: str = ""
    notes: list[str] = field(default_factory=list)
    total: int | None = None  # the batch: samples per optimizer step
    steps: int | None = None

    @classmethod
    def of(cls, plan_fields: dict[str, Any], **more: Any) -> "PlanEvent":
        data = {**plan_fields, **more}
        return cls(line=data.pop("line", ""), notes=list(data.pop("notes", [])), total=data.pop("total", None),
                   steps=data.pop("steps", None), extra=data)


@dataclass(frozen=True, kw_only=True)
class ResumedEvent(Event):
    kind: ClassVar[str] = "resumed"
    step: int
    checkpoint: str = ""
    changes: dict[str, Any] = field(default_factory=dict)  # key -> [old, new]
    plan: PlanEvent | None = None
    line: str = ""


@dataclass(frozen=True, kw_only=True)
class ProgressEvent(Event):
    kind: ClassVar[str] = "progress"
    # a non-finite loss is null, and so is the rate of a step that compiled: the key is there either way
    always_written: ClassVar[tuple[str, ...]] = ("steps", "loss", "lr", "samples_per_s", "eta_s", "epoch")
    step: int
    steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    samples_per_s: float | None = None
    eta_s: float | None = None
    epoch: float | None = None
    ranks_step: int | None = None  # the step `ranks` describes (trainer.engine.telemetry)
    ranks: list[dict[str, float]] | None = None
    data_s: float | None = None
    slowest_rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class SampleEvent(Event):
    kind: ClassVar[str] = "sample"
    step: int
    path: str  # relative to the run folder
    prompt: str = ""
    index: int = 0

    def check(self) -> None:
        path = PurePosixPath(self.path)
        if path.is_absolute() or ".." in path.parts or "\\" in self.path:
            raise BadEvent(f"a sample event's path is {self.path!r}, not a file in the run folder")


@dataclass(frozen=True, kw_only=True)
class EvalEvent(Event):
    """`extra` holds the metrics (map, map50, per_class, val_loss, val_images, concept, control...)."""
    kind: ClassVar[str] = "eval"
    step: int


@dataclass(frozen=True, kw_only=True)
class BestEvent(Event):
    kind: ClassVar[str] = "best"
    step: int
    metric: str = ""
    value: float | None = None
    mode: str = "max"
    path: str = ""
    previous: float | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True, kw_only=True)
class WarningEvent(Event):
    kind: ClassVar[str] = "warning"
    message: str
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class ExportEvent(Event):
    kind: ClassVar[str] = "export"
    step: int
    outputs: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class DoneEvent(Event):
    kind: ClassVar[str] = "done"
    step: int | None = None
    outputs: list[str] = field(default_factory=list)
    hub: str | None = None  # the Hub repo's URL (output.push_to_hub)


@dataclass(frozen=True, kw_only=True)
class StoppedEvent(Event):
    kind: ClassVar[str] = "stopped"
    step: int | None = None
    reason: str | None = None
    checkpoint: str | None = None  # to resume from; None when the run had none


@dataclass(frozen=True, kw_only=True)
class FailedEvent(Event):
    kind: ClassVar[str] = "failed"
    reason: str = "no reason given"
    step: int | None = None
    exitcode: int | None = None
    killed: bool = False  # ended by Kill (the UI's button, or the launcher after a stall)


AnyEvent = Union[PlanEvent, ResumedEvent, ProgressEvent, SampleEvent, EvalEvent, BestEvent, CheckpointEvent,
                 WarningEvent, ExportEvent, DoneEvent, StoppedEvent, FailedEvent]
FinalEvent = Union[DoneEvent, StoppedEvent, FailedEvent]
KINDS: dict[str, type[Event]] = {cls.kind: cls for cls in typing.get_args(AnyEvent)}


def parse(data: dict[str, Any]) -> AnyEvent | None:
    """The event of a line of events.jsonl; None for a kind no reader knows (a newer writer's); BadEvent if a
    declared field has another type."""
    kind = data.get("type")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    event = _build(cls, data)
    event.check()
    return typing.cast(AnyEvent, event)


def _build(cls: type[Event], data: dict[str, Any]) -> Event:
    hints = _hints(cls)
    declared, extra = {}, {}
    for key, value in data.items():
        if key == "type":
            continue
        if key in hints and key != "extra":
            declared[key] = _checked(cls.kind, key, value, hints[key])
        else:
            extra[key] = value
    try:
        return cls(extra=extra, **declared)
    except TypeError as exc:  # a required field missing
        raise BadEvent(f"a {cls.kind} event lacks a field ({exc})") from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _checked(kind: str, key: str, value: Any, hint: Any) -> Any:
    if _fits(value, hint):
        if isinstance(hint, type) and issubclass(hint, Event):
            return _build(hint, value)
        for arg in typing.get_args(hint):
            if isinstance(arg, type) and issubclass(arg, Event) and isinstance(value, dict):
                return _build(arg, value)
        if isinstance(value, int) and not isinstance(value, bool) and not _fits(value, _no_float(hint)):
            return float(value)  # a whole number where a float is declared (a loss of exactly 0)
        return value
    raise BadEvent(f"a {kind} event's {key} is {value!r}"[:200])


def _no_float(hint: Any) -> Any:
    """`hint` without its float (to tell whether an int fits it as an int)."""
    args = [a for a in typing.get_args(hint) if a is not float] if typing.get_args(hint) else [hint]
    return Union[tuple(a for a in args if a is not float)] if any(a is not float for a in args) else type(None)


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, Event):
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict:
        _, item = typing.get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(isinstance(k, str) and _fits(v, item) for k, v in value.items())
    return isinstance(value, hint)
