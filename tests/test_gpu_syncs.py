"""On a CUDA GPU, a training step makes one host sync: reading its all-reduce (trainer.engine.loop._reduce_step).

Every other host -> device copy of the step is queued without waiting (trainer.families.components.transfer), so the
CPU keeps launching kernels while the GPU works. CUDA's sync-debug mode warns at each synchronising call; the
test counts them over the tiny SD LoRA's steps (the family's loss with cached latents, backward, clipping,
AdamW, the loop's reduction). Skipped without a GPU: bench/device_engine_check.sh runs it on the device machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from trainer.core.config import load_config
from trainer.core.plan import make_plan
from trainer.core.hardware import Hardware
from trainer.families.protocol import Sample, WorkerContext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _Accelerator:
    def wait_for_everyone(self):
        pass


def test_a_lora_step_syncs_the_host_once(tmp_path, tiny_sd_path, demo_data_path):
    from trainer.engine.loop import _reduce_step
    from trainer.engine.optim import build_optimizer
    from trainer.families import get_family

    config = load_config(None, [f"model.path={tiny_sd_path}", f"data.path={demo_data_path}", "precision=bf16",
                                "devices=1", "batch.total=2", "batch.per_device=2", "data.resolution=64"])
    hw = Hardware(gpu_count=1, gpu_names=("gpu",), gpu_memory_gb=(16.0,), bf16=True, cpu_count=4)
    device = torch.device("cuda", 0)
    ctx = WorkerContext(config, make_plan(config, hw), tmp_path / "run", tmp_path / "cache", device, 0, 1,
                        _Accelerator(), lambda message: None, unwrap=lambda module: module)
    family = get_family("sd")(ctx)
    family.load()
    family.prepare_data()
    family.set_prepared(family.trainable_modules())
    optimizer = build_optimizer(family.param_groups(), config.train)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def step(n: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = family.loss([Sample(2 * n, 0, 0), Sample(2 * n + 1, 0, 1)])
        loss.backward()
        _reduce_step([loss.detach().float()], False, device, [0.0] * 9, 0, 1)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)  # first-use allocations and copies (the scheduler's tables reach the device once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in range(1, 4):
                step(n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 3, "\n".join(syncs)  # one per step: the all-reduce's result read on the host
