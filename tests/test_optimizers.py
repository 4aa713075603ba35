"""train.optimizer prodigy / adafactor / adamw_schedulefree, and the schedule keys train.scheduler_cycles and
train.scheduler_power: each does what its help says, and a run stopped with it resumes exactly."""

import pytest
import torch

from tests.engine_helpers import assert_same_weights, engine_config, final_weights, launch, log_of
from trainer.core.config import load_config
from trainer.core.config.schema import TrainConfig
from trainer.core.hardware import CPU_ONLY, Hardware
from trainer.core.plan import make_plan
from trainer.core.resume import resume_run
from trainer.engine.optim import averaged_weights, build_optimizer, build_scheduler
from trainer.errors import ConfigError


def _model_and_groups(lr=1e-2):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, [{"params": list(model.parameters()), "lr": lr}]


def _steps(model, optimizer, n=5):
    for i in range(n):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_cosine_with_restarts_restarts_scheduler_cycles_times():
    _, groups = _model_and_groups(lr=1.0)
    train = TrainConfig(steps=10, scheduler="cosine_with_restarts", scheduler_cycles=2, optimizer="sgd")
    optimizer = build_optimizer(groups, train)
    scheduler = build_scheduler(optimizer, train)
    lrs = []
    for _ in range(10):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1.0) and lrs[5] == pytest.approx(1.0)  # back to the peak at the half
    assert lrs[4] < 0.2 and lrs[9] < 0.2


def test_polynomial_decays_with_scheduler_power():
    def at_half(power):
        _, groups = _model_and_groups(lr=1.0)
        train = TrainConfig(steps=10, scheduler="polynomial", scheduler_power=power, optimizer="sgd")
        optimizer = build_optimizer(groups, train)
        scheduler = build_scheduler(optimizer, train)
        for _ in range(5):
            optimizer.step()
            scheduler.step()
        return scheduler.get_last_lr()[0]

    assert at_half(1.0) == pytest.approx(0.5, abs=1e-3) and at_half(2.0) == pytest.approx(0.25, abs=1e-3)


def test_weight_decay_and_clipping_default_to_the_optimizers_usual_values():
    """Unset, train.weight_decay is AdamW's decoupled 1e-2 but SGD's 1e-4, and train.max_grad_norm clips at 1.0
    for AdamW but not at all for SGD (torchvision's detection recipe): SGD's L2 term at 1e-2 and a cap at 1 each
    cost a from-scratch Faster R-CNN much of its mAP (bench/detection_parity.py). A set value stays."""
    weight = torch.nn.Parameter(torch.ones(2))

    def decay(**train):
        optimizer = build_optimizer([{"params": [weight], "lr": 0.1}], TrainConfig(**train))
        return optimizer.param_groups[0]["weight_decay"]

    sgd = load_config(None, ["train.optimizer=sgd"], check_paths=False).train
    assert sgd.weight_decay is None and sgd.max_grad_norm is None
    assert decay(optimizer="sgd") == 1e-4 and decay(optimizer="adamw") == 1e-2
    assert decay(optimizer="sgd", weight_decay=1e-2) == 1e-2 and decay(optimizer="adamw", weight_decay=0.0) == 0.0
    assert sgd.clip_norm() == 0.0 and TrainConfig(optimizer="adamw").clip_norm() == 1.0
    assert TrainConfig(optimizer="sgd", max_grad_norm=2.0).clip_norm() == 2.0
    assert TrainConfig(optimizer="prodigy", max_grad_norm=0.0).clip_norm() == 0.0


def test_prodigy_estimates_its_own_step_size():
    model, groups = _model_and_groups(lr=1.0)
    optimizer = build_optimizer(groups, TrainConfig(optimizer="prodigy", warmup_steps=0))
    before = optimizer.param_groups[0]["d"]
    _steps(model, optimizer)
    assert optimizer.param_groups[0]["d"] > before  # d grows from d0 = 1e-6: lr 1.0 is not the step size


def test_adafactor_keeps_factored_state_and_uses_the_given_rate():
    model, groups = _model_and_groups(lr=1e-2)
    optimizer = build_optimizer(groups, TrainConfig(optimizer="adafactor"))
    before = model.weight.detach().clone()
    _steps(model, optimizer, 1)
    state = optimizer.state[model.weight]
    assert "exp_avg_sq_row" in state and "exp_avg_sq_col" in state  # a row and a column, not a full matrix
    assert not torch.equal(before, model.weight)


def test_schedule_free_samples_with_the_averaged_weights_and_trains_on_exactly_what_it_had():
    model, groups = _model_and_groups(lr=1e-2)
    optimizer = build_optimizer(groups, TrainConfig(optimizer="adamw_schedulefree"))
    _steps(model, optimizer)
    training = model.weight.detach().clone()
    with averaged_weights(optimizer):
        averaged = model.weight.detach().clone()
    assert not torch.equal(averaged, training)
    assert torch.equal(model.weight, training)  # bit for bit, not eval() then train()
    _steps(model, optimizer, 1)  # still in train mode: it would refuse to step otherwise


def test_the_schedule_free_and_sharding_rules_are_said_up_front():
    with pytest.raises(ConfigError, match="train.scheduler: cosine with train.optimizer=adamw_schedulefree"):
        load_config(None, ["train.optimizer=adamw_schedulefree", "train.scheduler=cosine"], check_paths=False)
    config = load_config(None, ["train.optimizer=prodigy", "method=full", "distributed.sharding=fsdp",
                                "devices=cpu:2", "train.lr=1.0"], check_paths=False)
    with pytest.raises(ConfigError, match="prodigy is not supported with distributed.sharding=fsdp"):
        make_plan(config, Hardware(cpu_count=2))
    config = load_config(None, ["train.optimizer=prodigy", "devices=cpu:1"], check_paths=False)
    assert any("prodigy estimates its own step size" in n for n in make_plan(config, Hardware()).notes)


def test_a_missing_optimizer_package_is_named_with_its_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    with pytest.raises(ConfigError, match=r"prodigy needs the `prodigyopt` package.*imagetune\[optimizers\]"):
        load_config(None, ["train.optimizer=prodigy"], check_paths=False)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,lr", [("prodigy", "1.0"), ("adafactor", "1e-3"), ("adamw_schedulefree", "1e-3")])
def test_a_run_resumes_exactly_with_each_optimizer(tmp_path, tiny_sd_path, demo_data_path, optimizer, lr):
    common = ["devices=cpu:1", "batch.per_device=2", f"train.optimizer={optimizer}", f"train.lr={lr}",
              "train.scheduler=constant", "train.warmup_steps=0"]
    reference, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, *common, "name=whole"))
    assert final["type"] == "done", log_of(reference)
    # Half the steps, then resumed to the end; samples every step on the way (schedule-free swaps in its
    # averaged weights for them and must hand back exactly the ones it trains on).
    half, final = launch(tmp_path, engine_config(tiny_sd_path, demo_data_path, *common, "train.steps=2",
                                                 "sample.every=1", "sample.prompts=[a red circle]",
                                                 "sample.steps=2", "name=half"))
    assert final["type"] == "done", log_of(half)
    final = resume_run(half, ["train.steps=4"], hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(half)
    assert_same_weights(final_weights(reference), final_weights(half), rtol=0, atol=0)
