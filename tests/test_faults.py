"""The test-only fault switch (trainer.engine.faults) that the stop/kill tests rely on: a value that does not
mean what the test thinks must fail loudly rather than let the run pass without its fault."""

import pytest

from trainer.engine import faults
from trainer.engine.faults import Fault


def test_absent_means_no_fault_and_a_stop_touches_the_stop_file_at_its_step(tmp_path):
    assert faults.from_env({}) == faults.NO_FAULT
    fault = faults.from_env({faults.ENV: "stop_at_step=2"})
    stop_file = tmp_path / "STOP"
    fault.before_vote(stop_file, 1)
    assert not stop_file.exists()
    fault.before_vote(stop_file, 2)
    assert stop_file.exists()
    fault.step_ended(rank=0, step=2)  # a stop is not a crash: this returns


def test_kill_and_hang_name_a_rank_and_a_step():
    assert faults.parse("kill_rank=1,at_step=2") == Fault(kill_rank=1, at_step=2)
    assert faults.parse(" hang_rank=0 , at_step=3 ") == Fault(hang_rank=0, at_step=3)
    Fault(kill_rank=1, at_step=2).step_ended(rank=0, step=2)  # another rank: nothing happens
    Fault(kill_rank=1, at_step=2).step_ended(rank=1, step=1)  # another step: nothing happens


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("stop_at=2", "'stop_at=2' is not one of"),
    ("stop_at_step", "is not one of"),
    ("stop_at_step=two", "needs a whole number"),
    ("stop_at_step=0", "out of range"),
    ("stop_at_step=1,stop_at_step=2", "each once"),
    ("kill_rank=1", "goes with at_step"),
    ("at_step=2", "goes with at_step"),
    ("kill_rank=1,hang_rank=0,at_step=2", "one of them"),
])
def test_malformed_values_fail_loudly(text, words):
    with pytest.raises(ValueError, match=faults.ENV) as err:
        faults.from_env({faults.ENV: text})
    assert words in str(err.value)
