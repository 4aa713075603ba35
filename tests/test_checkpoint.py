"""Atomic checkpoints: a failed write (disk full) leaves the previous checkpoint intact and nothing half-written."""

import errno

import pytest

from trainer.core.checkpoint import (
    COMPLETE, CheckpointWriteError, complete_checkpoints, latest_checkpoint, save_checkpoint,
)


def _writer(text):
    return lambda path: path.write_text(text)


def test_checkpoints_are_complete_and_only_the_last_k_are_kept(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"weights.txt": _writer(f"w{step}")}, keep=2, info={})
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20, 30]
    latest = latest_checkpoint(tmp_path).path
    assert latest.name == "step-000030" and (latest / "weights.txt").read_text() == "w30"
    assert (latest / COMPLETE).is_file()


def test_disk_full_keeps_the_previous_checkpoint_intact(tmp_path):
    save_checkpoint(tmp_path, 10, {"weights.txt": _writer("good")}, keep=2, info={})

    def disk_full(path):
        path.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match="No space left on device") as err:
        save_checkpoint(tmp_path, 20, {"weights.txt": _writer("new"), "optimizer.pt": disk_full}, keep=1, info={})
    assert err.value.errno == errno.ENOSPC
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [10]  # keep=1 did not prune the good one
    assert (latest_checkpoint(tmp_path).path / "weights.txt").read_text() == "good"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000010"]  # no temp left


def test_a_folder_without_the_complete_marker_is_never_resumed_from(tmp_path):
    save_checkpoint(tmp_path, 10, {"weights.txt": _writer("good")}, keep=3, info={})
    crashed = tmp_path / "checkpoints" / "step-000020"
    crashed.mkdir()
    (crashed / "weights.txt").write_text("torn")
    (tmp_path / "checkpoints" / ".tmp-step-000030-123").mkdir()
    assert latest_checkpoint(tmp_path).path.name == "step-000010"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 10, {"weights.txt": _writer("first")}, keep=2, info={})
    save_checkpoint(tmp_path, 10, {"weights.txt": _writer("second")}, keep=2, info={})
    assert (latest_checkpoint(tmp_path).path / "weights.txt").read_text() == "second"
