"""The Generate panel's pieces that need no model: the LoRA scale's arithmetic, the form's bounds, which devices a
generation takes (tests/test_queue.py: how it waits for them). (tests/test_export_checkpoint.py draws the demo through the real process.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.generations import Request, held_devices
from trainer.engine.generate import scaled_state
from trainer.errors import UserError


def test_the_lora_scale_weighs_the_trained_change_exactly():
    base = {"x.lora_A.weight": torch.randn(2, 4), "x.lora_B.weight": torch.zeros(4, 2), "norm.weight": torch.ones(3)}
    trained = {"x.lora_A.weight": torch.randn(2, 4), "x.lora_B.weight": torch.randn(4, 2), "norm.weight": torch.full((3,), 3.0)}
    delta = trained["x.lora_B.weight"] @ trained["x.lora_A.weight"]
    for scale in (0.0, 0.5, 1.0, 1.5):
        got = scaled_state(base, trained, scale)
        assert torch.allclose(got["x.lora_B.weight"] @ got["x.lora_A.weight"], scale * delta)  # B.A scales by `scale`
        assert torch.allclose(got["norm.weight"], torch.full((3,), 1.0 + 2.0 * scale))  # full weights: interpolated
    assert torch.equal(scaled_state(base, trained, 0.0)["norm.weight"], base["norm.weight"])


@pytest.mark.parametrize("change, message", [
    ({"prompt": "   "}, "Type a prompt"),
    ({"steps": 0}, "steps: 0 is not between 1 and 200"),
    ({"guidance": math.inf}, "guidance"),
    ({"scale": 9}, "LoRA scale: 9 is not between -2 and 3"),
    ({"seed": -1}, "seed"),
    ({"steps": "many"}, "steps: 'many'"),
])
def test_the_form_is_checked_before_anything_starts(change, message):
    with pytest.raises(UserError, match=message):
        Request(**{"step": 2, "prompt": "a dog", **change}).checked()


def test_a_request_is_normalised_and_passed_as_arguments_never_through_a_shell(tmp_path):
    request = Request(step=2, prompt="  a dog;\n rm -rf /  ", seed=3.0, steps=10.0, guidance=5, scale=1).checked()
    assert request == Request(2, "a dog; rm -rf /", 3, 10, 5.0, 1.0)
    argv = request.argv(tmp_path / "run", tmp_path / "out")
    assert argv[argv.index("--prompt") + 1] == "a dog; rm -rf /" and argv[1:3] == ["-m", "trainer.engine.generate"]


def test_a_generation_takes_the_devices_its_run_trained_on(tmp_path):
    for name, devices in (("cpu", "cpu"), ("gpus", [2, 3]), ("unknown", None)):
        (tmp_path / name).mkdir()
        if devices is not None:
            (tmp_path / name / "plan.json").write_text(json.dumps({"devices": devices}))
    assert held_devices(tmp_path / "cpu") == frozenset({"cpu"})  # it waits for a CPU training (2 cores shared)
    assert held_devices(tmp_path / "gpus") == frozenset({"gpu:2", "gpu:3"})
    assert held_devices(tmp_path / "unknown") is None  # no plan: every device
