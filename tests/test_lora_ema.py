"""lora.ema (and full.ema): diffusers' EMAModel over the trained weights, its decay as lora.ema_decay says, swapped
in for samples, evaluations and outputs and handed back bit for bit, so training is what it would have been."""

from types import SimpleNamespace

import pytest
import torch

from trainer.core.config import load_config
from trainer.core.hardware import Hardware
from trainer.core.plan import make_plan
from trainer.engine.ema import build_ema, ema_decay, ema_weights
from trainer.engine.run_io import draw_samples
from trainer.errors import ConfigError


def _run(model, decay=0.5):
    config = load_config(None, ["lora.ema=true", f"lora.ema_decay={decay}"], check_paths=False)
    params = [p for p in model.parameters()]
    return SimpleNamespace(config=config, ema=build_ema(config, params), trainable_params=lambda: params)


def test_the_average_follows_the_decay_its_help_states():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    run = _run(model, decay=0.5)
    expected = [p.detach().clone() for p in model.parameters()]
    for n in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        run.ema.step(run.trainable_params())
        d = 0.0 if n == 1 else min(0.5, n / (n + 9))  # lora.ema_decay's help
        expected = [e - (1 - d) * (e - p.detach()) for e, p in zip(expected, model.parameters())]
    for shadow, e, live in zip(run.ema.shadow_params, expected, model.parameters()):
        torch.testing.assert_close(shadow, e)
        assert not torch.allclose(shadow, live)  # the average lags the live weights


def test_samples_see_the_average_and_training_gets_its_weights_back_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    run = _run(model)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        run.ema.step(run.trainable_params())
    live = model.weight.detach().clone()
    seen = []

    def render_samples(step):
        seen.append(model.weight.detach().clone())
        return []

    class Parallel:
        shards_weights = False

        def gathered(self, *args):
            from contextlib import nullcontext
            return nullcontext()

    run.family = SimpleNamespace(render_samples=render_samples)
    run.state, run.plan, run.parallel = SimpleNamespace(step=3), SimpleNamespace(precision="fp32"), Parallel()
    run.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, device="cpu")
    run.run_dir, run.events = tmp_path, SimpleNamespace(emit=lambda *a, **k: None)
    run.config.sample.prompts = ["a red circle"]
    draw_samples(run)
    torch.testing.assert_close(seen[0], run.ema.shadow_params[0])
    assert not torch.equal(seen[0], live)
    assert torch.equal(model.weight, live)  # bit for bit


def test_which_runs_keep_an_average():
    def decay(*overrides):
        return ema_decay(load_config(None, list(overrides), check_paths=False))

    assert decay() is None and decay("lora.ema=true") == 0.999
    assert decay("method=full", "full.ema=true") == 0.9999
    assert decay("method=full", "lora.ema=true") is None  # lora.* is the LoRA's; a full fine-tune reads full.ema
    with torch.no_grad():
        assert build_ema(load_config(None, [], check_paths=False), []) is None


def test_sharded_runs_refuse_a_lora_and_so_its_average():
    config = load_config(None, ["lora.ema=true", "devices=cpu:2", "distributed.sharding=fsdp"], check_paths=False)
    with pytest.raises(ConfigError, match="fsdp is for full fine-tunes"):
        make_plan(config, Hardware(cpu_count=2))


@pytest.mark.slow
def test_a_lora_ema_run_resumes_exactly_and_its_output_is_the_average(tmp_path, tiny_sd_path, demo_data_path):
    from safetensors.torch import load_file

    from tests.engine_helpers import assert_same_weights, engine_config, final_weights, launch, log_of
    from trainer.core.checkpoint import latest_checkpoint
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.resume import resume_run

    common = ["devices=cpu:1", "batch.per_device=2", "train.steps=3", "lora.ema=true", "lora.ema_decay=0.5",
              "checkpoint.every=1"]
    whole, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, *common, "name=whole"))
    assert final["type"] == "done", log_of(whole)
    stopped, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, *common, "name=stopped"),
                            fault="stop_at_step=2")
    assert final["type"] == "stopped", log_of(stopped)
    assert resume_run(stopped, hw=CPU_ONLY).wait(timeout=300)["type"] == "done", log_of(stopped)

    def ema_state(run_dir):
        state = torch.load(latest_checkpoint(run_dir).path / "training_state.pt", weights_only=False)["ema"]
        return state["shadow_params"], state["optimization_step"]

    live = final_weights(whole)
    assert_same_weights(final_weights(stopped), live, rtol=0, atol=0)
    (shadow, updates), (resumed_shadow, resumed_updates) = ema_state(whole), ema_state(stopped)
    assert updates == resumed_updates == 3
    for a, b in zip(shadow, resumed_shadow):
        assert torch.equal(a, b)
    # The output is the average, not the live weights: each up weight of the diffusers file is one of the
    # average's tensors, and (up weights start at zero; decay 0.5 lags behind) not the live one
    output = load_file(str(whole / "output" / "pytorch_lora_weights.safetensors"))
    ups = [n for n in live if n.startswith("unet.") and ".lora_B." in n]
    assert ups
    for name in ups:
        written = output[name.replace(".lora_B.default.weight", ".lora.up.weight")]
        assert any(s.shape == written.shape and torch.equal(s, written) for s in shadow), name
        assert not torch.allclose(written, live[name]), name
