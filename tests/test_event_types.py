"""The typed events (trainer.core.event_types): what a writer emits is what a reader parses back, and a line whose
fields have other types is refused naming the field."""

from __future__ import annotations

import json

import pytest

from trainer.core.event_types import (KINDS, BadEvent, BestEvent, CheckpointEvent, DoneEvent, EvalEvent, ExportEvent,
                                      FailedEvent, PlanEvent, ProgressEvent, ResumedEvent, SampleEvent, StoppedEvent,
                                      WarningEvent, parse)
from trainer.core.events import EventLog, read_events

WRITTEN = [
    PlanEvent.of({"line": "1 process", "notes": ["n"], "total": 2, "steps": 10, "world_size": 1}, node_rank=0),
    ResumedEvent(step=3, checkpoint="checkpoints/step-000003", changes={"train.lr": [1e-3, 1e-4]},
                 plan=PlanEvent.of({"line": "2 processes", "total": 4, "devices": "cpu"}), line="2 processes"),
    ProgressEvent(step=4, steps=10, loss=0.25, lr=1e-3, samples_per_s=8.0, eta_s=1.5, epoch=0.5, ranks_step=3,
                  ranks=[{"rank": 0, "step_s": 0.1}], data_s=0.01, slowest_rank=0),
    SampleEvent(step=4, prompt="a cat", index=1, path="samples/step-000004-p01.png"),
    EvalEvent(step=4, extra={"val_loss": 0.3, "val_images": 4}),
    BestEvent(step=4, metric="val_loss", value=0.3, mode="min", path="checkpoints/best"),
    CheckpointEvent(step=4, path="checkpoints/step-000004"),
    WarningEvent(message="disk nearly full", step=4),
    ExportEvent(step=4, outputs=["output/step-000004/pytorch_lora_weights.safetensors"]),
    DoneEvent(step=10, outputs=["output/x.safetensors"], hub="https://huggingface.co/me/x", extra={"overflow_steps": 0}),
    StoppedEvent(step=5, reason="STOP file", checkpoint="checkpoints/step-000005"),
    FailedEvent(reason="killed", exitcode=-9, killed=True, extra={"log": "train.log"}),
]


def test_every_kind_reads_back_as_written(tmp_path):
    assert {type(e) for e in WRITTEN} == set(KINDS.values())
    log = EventLog(tmp_path)
    for event in WRITTEN:
        log.emit(event)
    lines = read_events(tmp_path)
    assert [line["type"] for line in lines] == [e.kind for e in WRITTEN]
    for written, line in zip(WRITTEN, lines):
        back = parse(line)
        assert back is not None and back.time > 0
        assert back == type(written)(**{**written.__dict__, "time": back.time})
    # The file reads as it did before the types: the extra fields beside the declared ones, no empty optionals.
    assert lines[0]["world_size"] == 1 and lines[0]["node_rank"] == 0
    assert lines[4] == {"type": "eval", "time": lines[4]["time"], "step": 4, "val_loss": 0.3, "val_images": 4}
    assert "hub" not in log.emit(DoneEvent(step=1))


@pytest.mark.parametrize("line, field", [
    ({"type": "progress", "step": "3"}, "step is '3'"),
    ({"type": "progress", "step": 1, "loss": "NaNish"}, "loss is 'NaNish'"),
    ({"type": "progress", "step": True}, "step is True"),
    ({"type": "progress", "step": 1, "ranks": [{"rank": 0, "step_s": "<b>"}]}, "ranks is"),
    ({"type": "sample", "step": 1, "path": "../../etc/passwd"}, "not a file in the run folder"),
    ({"type": "sample", "step": 1, "path": {"a": 1}}, "path is {'a': 1}"),
    ({"type": "resumed", "step": 1, "plan": {"notes": "not a list"}}, "notes is 'not a list'"),
    ({"type": "checkpoint", "step": 1}, "lacks a field"),
])
def test_a_field_of_another_type_is_refused_by_name(line, field):
    with pytest.raises(BadEvent, match="^a (progress|sample|resumed|plan|checkpoint) event"):
        parse(line)
    with pytest.raises(BadEvent) as caught:
        parse(line)
    assert field in str(caught.value)


def test_unknown_kinds_are_skipped_and_whole_numbers_read_as_floats():
    assert parse({"type": "from-a-newer-writer", "step": "x"}) is None
    event = parse(json.loads('{"type": "progress", "step": 2, "loss": 0, "time": 5}'))
    assert isinstance(event, ProgressEvent) and isinstance(event.loss, float) and event.time == 5.0
