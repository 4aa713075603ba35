"""`batch.per_device: auto`: on GPUs the workers keep the largest micro-batch whose real training step fits, the
same on every rank, with the effective batch unchanged; on the CPU (and under FSDP/DeepSpeed) the plan says 1.
Running out of memory is simulated here (no GPU on CI): the family's loss raises CUDA's OutOfMemoryError above a
size, as torch does."""

from types import SimpleNamespace

import pytest
import torch

from tests.test_plan import AMPERE_X4, CPU
from trainer.core.config import load_config
from trainer.core.plan import make_plan
from trainer.engine.batch_probe import candidates, probe_per_device


def plan_of(hw, *overrides):
    return make_plan(load_config(None, ["batch.per_device=auto", *overrides], check_paths=False), hw)


def test_the_plan_probes_on_gpus_and_says_1_elsewhere():
    gpu = plan_of(AMPERE_X4, "batch.total=16")
    assert gpu.probe_batch and gpu.per_device == 1 and gpu.accumulation == 4
    assert any("try the real step at growing micro-batches" in n for n in gpu.notes)
    cpu = plan_of(CPU, "batch.total=4")
    assert not cpu.probe_batch and any("1 on the CPU" in n for n in cpu.notes)
    sharded = plan_of(AMPERE_X4, "batch.total=16", "method=full", "distributed.sharding=fsdp")
    assert not sharded.probe_batch and any("1 under fsdp" in n for n in sharded.notes)
    assert candidates(gpu) == [1, 2, 4]  # the divisors of each GPU's share (16 / 4)


def test_the_largest_size_that_fits_is_kept_and_the_ranks_agree_on_the_smallest():
    plan = plan_of(AMPERE_X4, "batch.total=32")  # 8 per GPU: tries 1, 2, 4, 8
    weight = torch.nn.Parameter(torch.ones(3))
    tried = []

    def run_loss(size):
        tried.append(size)
        if size > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        torch.rand(1)  # a draw: the probe must leave the global random state as it found it
        return (weight * size).sum()

    state = torch.get_rng_state()
    resolved = probe_per_device(run_loss, [weight], plan, agree=lambda n: n)
    assert tried == [1, 2, 4, 8] and (resolved.per_device, resolved.accumulation) == (4, 2)
    assert resolved.total == plan.total and weight.grad is None and torch.equal(torch.get_rng_state(), state)
    assert "4 per device fits" in resolved.notes[-1]
    # Another rank fits only 2: every rank takes 2.
    agreed = probe_per_device(run_loss, [weight], plan, agree=lambda n: min(n, 2))
    assert (agreed.per_device, agreed.accumulation) == (2, 4)


def test_an_error_other_than_out_of_memory_is_not_swallowed():
    plan = plan_of(AMPERE_X4, "batch.total=16")
    with pytest.raises(ValueError, match="a bug"):
        probe_per_device(lambda size: (_ for _ in ()).throw(ValueError("a bug")), [], plan, agree=lambda n: n)


@pytest.mark.slow
def test_the_worker_probes_with_the_familys_real_loss(tmp_path, tiny_sd_path):
    """The worker's probe on the tiny SD model in process: real samples of step 0 at each size, the real loss and
    backward; above 2 samples the loss runs out of memory (simulated). The weights and gradients are untouched."""
    from dataclasses import replace

    from tests.test_caption_augment import _family
    from trainer.engine.worker import _probe_batch

    family, _ = _family(tmp_path, "sd", tiny_sd_path)
    items = len(family.data.expanded)
    sizes = []
    real_loss = family.loss

    def loss(samples):
        sizes.append(len(samples))
        if len(samples) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return real_loss(samples)

    family.loss = loss
    before = {k: v.clone() for k, v in family.trainable_state().items()}
    plan = replace(family.ctx.plan, total=4, per_device=1, accumulation=4, probe_batch=True)
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    resolved = _probe_batch(family, items, plan, family.cfg, acc)
    assert sizes == [1, 2, 4] and (resolved.per_device, resolved.accumulation) == (2, 2)
    after = family.trainable_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for m in family.trainable_modules() for p in m.parameters())
