"""`model.fp8_compute`: with fp8 base weights, the frozen Linear layers of a LoRA run multiply in fp8
(trainer.families.components.fp8_linear) where the GPUs have fp8 tensor cores, and the plan says which path a run
takes. On the CPU through torch's own fp8 matmul (`torch._scaled_mm`), which the CUDA kernels match up to
accumulation order: the layer against a bf16 reference, a peft LoRA on top of it, the tiny FLUX family in
process, and the shipped tiny SD through the real launcher on 2 DDP processes."""

import pytest
import torch

from tests.test_bucketing_families import make_family, mixed_data  # noqa: F401 (fixtures)
from trainer.core.config import load_config
from trainer.core.hardware import Hardware
from trainer.core.plan import make_plan
from trainer.errors import ConfigError
from trainer.families.components.fp8_linear import Fp8Linear, swap_in_fp8_linears

FP8 = ["model.base_weights=fp8", "train.gradient_checkpointing=true"]


def _gpus(*capability):
    return Hardware(gpu_count=len(capability), bf16=True, gpu_capability=tuple(capability))


def _plan(hw, *overrides):
    return make_plan(load_config(None, [*FP8, *overrides], check_paths=False), hw)


@pytest.mark.parametrize("hw, compute, note", [
    (_gpus(8.9), True, None),                      # Ada
    (_gpus(9.0, 9.0), True, None),                 # Hopper
    (_gpus(9.0, 8.0), False, "compute capability 8.0"),  # one A100 in the run: the storage path for all
    (_gpus(8.0), False, "compute capability 8.0"),
    (Hardware(gpu_count=1, bf16=True), False, "unknown"),  # a probe without capabilities
    (Hardware(cpu_count=2), False, "on the CPU"),
])
def test_auto_takes_the_fp8_matmul_only_where_the_gpus_have_it(hw, compute, note):
    plan = _plan(hw, "model.fp8_compute=auto")
    assert plan.fp8_compute is compute and ("· fp8 matmul ·" in plan.line()) is compute
    fp8_notes = [n for n in plan.notes if n.startswith("model.fp8_compute")]
    if note is None:
        assert fp8_notes == []
    else:
        assert len(fp8_notes) == 1 and note in fp8_notes[0] and "saves memory, not time" in fp8_notes[0]
    assert plan.fp8_compute == type(plan).from_event(plan.event()).fp8_compute  # what the workers read


def test_on_off_and_other_storages():
    assert _plan(_gpus(9.0), "model.fp8_compute=off").fp8_compute is False
    assert _plan(_gpus(9.0), "model.fp8_compute=off").notes == ()
    on_cpu = _plan(Hardware(cpu_count=2), "model.fp8_compute=on")  # the tests' path: torch's CPU fp8 matmul
    assert on_cpu.fp8_compute and "for tests" in on_cpu.notes[0]
    with pytest.raises(ConfigError, match="model.fp8_compute: on cannot run here: a GPU of this run has compute"):
        _plan(_gpus(8.0), "model.fp8_compute=on")
    default = make_plan(load_config(None, [], check_paths=False), _gpus(9.0))
    assert not default.fp8_compute and default.notes == ()  # auto is about fp8 base weights only
    # YAML 1.1 reads on / off as booleans: they still mean the words
    assert load_config({"model": {"fp8_compute": False}}, check_paths=False).model.fp8_compute == "off"


def test_validation_names_the_keys():
    with pytest.raises(ConfigError, match="set model.base_weights=fp8 too"):
        load_config(None, ["model.fp8_compute=on"], check_paths=False)
    with pytest.raises(ConfigError, match="model.fp8_compute=on on GPUs of compute capability 8.9"):
        load_config(None, ["model.base_weights=fp8", "train.gradient_checkpointing=false"], check_paths=False)
    # nothing is upcast on the compute path: no checkpointing needed for the memory
    load_config(None, ["model.base_weights=fp8", "model.fp8_compute=on", "train.gradient_checkpointing=false"],
                check_paths=False)


def test_a_torch_build_without_the_kernel_stops_the_run_naming_the_key(monkeypatch):
    """Capability 8.9+ is the plan's test; the kernel itself is tried on the device before anything is quantized."""
    from trainer.errors import UserError
    from trainer.families.components import fp8_linear

    fp8_linear.require_fp8_matmul(torch.device("cpu"))  # torch's CPU kernel: there

    def missing(*args, **kwargs):
        raise RuntimeError("Rowwise scaling is not currently supported on your device")

    monkeypatch.setattr(fp8_linear, "_scaled_mm", missing)
    with pytest.raises(UserError, match="model.fp8_compute: this torch build has no row-wise fp8 matmul .* set "
                                        "model.fp8_compute=off"):
        fp8_linear.require_fp8_matmul(torch.device("cpu"))


def test_the_probe_reports_compute_capability_through_json():
    hw = _gpus(8.9, 12.0)
    assert Hardware.from_json(hw.to_json()) == hw


def _relative(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_layer_matches_a_bf16_linear_within_fp8_rounding(dtype):
    """Forward and input gradient against fp32 (`F.linear`): a bf16 Linear is off by about 0.3%, the fp8 layer
    by about 3.5% (e4m3 keeps 3 mantissa bits: each operand rounds by up to 1/16); the bound is 6%. Activations
    with outlier rows (as real ones have) cost nothing extra: scales are per row."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).requires_grad_(False)
    layer = Fp8Linear(linear, dtype)
    x = torch.randn(2, 10, 64) * torch.logspace(-2, 2, 10).view(1, 10, 1)  # rows spanning four decades
    grad = torch.randn(2, 10, 96)
    reference = x.clone().requires_grad_(True)
    torch.nn.functional.linear(reference, linear.weight, linear.bias).backward(grad)
    bf16 = x.bfloat16().requires_grad_(True)
    bf16_out = torch.nn.functional.linear(bf16, linear.weight.bfloat16(), linear.bias.bfloat16())
    bf16_out.backward(grad.bfloat16())

    inp = x.to(dtype).requires_grad_(True)
    out = layer(inp)
    out.backward(grad.to(dtype))
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert out.dtype == dtype and inp.grad.dtype == dtype
    assert _relative(bf16_out, expected) < 0.01 and _relative(bf16.grad, reference.grad) < 0.01
    assert 0.005 < _relative(out, expected) < 0.06  # really fp8, and within its rounding
    assert 0.005 < _relative(inp.grad, reference.grad) < 0.06
    for row in range(10):  # each row on its own scale: the small rows are as exact as the large ones
        assert _relative(out[:, row] - linear.bias, expected[:, row] - linear.bias) < 0.08
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.grad is None
    assert list(dict(layer.named_parameters())) == ["bias"]  # the e4m3 weight and its scales are buffers
    torch.testing.assert_close(layer.dequantized(), linear.weight, rtol=0.07, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as a Linear does under autocast
        assert layer(x).dtype == torch.bfloat16


def test_only_frozen_linears_with_dims_of_16_outside_norms_are_swapped():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q = torch.nn.Linear(32, 64)
            self.odd = torch.nn.Linear(40, 64)  # 40: not a multiple of 16, _scaled_mm would refuse it
            self.norm_out = torch.nn.Sequential(torch.nn.Linear(32, 32))  # under a skipped name
            self.trained = torch.nn.Linear(32, 32)
            self.conv = torch.nn.Conv2d(16, 16, 3)

    block = Block().requires_grad_(False)
    block.trained.requires_grad_(True)
    assert swap_in_fp8_linears(block, torch.float32, torch.device("cpu"), ("norm",)) == ["to_q"]
    assert isinstance(block.to_q, Fp8Linear)
    assert type(block.odd) is type(block.norm_out[0]) is type(block.trained) is torch.nn.Linear
    assert block.conv.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_a_peft_adapter_wraps_the_fp8_layer_and_trains(kind):
    """peft sees an nn.Linear and wraps it as its base layer; the adapter gets the compute dtype (fp32 here),
    not float8, and all the gradient; the frozen fp8 weight none."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from trainer.core.config.schema import LoraConfig
    from trainer.families.components.adapters import peft_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    model.requires_grad_(False)
    target = torch.nn.Linear(32, 16)  # the function to learn
    swap_in_fp8_linears(model, torch.float32, torch.device("cpu"))
    inject_adapter_in_model(peft_config(LoraConfig(type=kind, rank=4, alpha=4), ["0", "2"]), model)
    adapted = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert len(adapted) == 2 and all(isinstance(m.get_base_layer(), Fp8Linear) for m in adapted)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    losses = []
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    for step in range(30):
        loss = (model(x) - target(x).detach()).pow(2).mean()
        loss.backward()
        if step == 0:
            assert all(p.grad is not None for p in trained)
            assert all(b.grad is None for m in adapted for b in (m.get_base_layer().weight,))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_ddp_leaves_the_fp8_weights_alone():
    """gloo cannot send float8, and DDP would broadcast buffers at every forward: it is told to ignore them."""
    from trainer.engine.parallel.ddp import _frozen_weights_stay_local

    model = torch.nn.Sequential(torch.nn.Linear(32, 32)).requires_grad_(False)
    swap_in_fp8_linears(model, torch.float32, torch.device("cpu"))
    _frozen_weights_stay_local([model])
    assert {"0.weight", "0.bias"} <= set(model._ddp_params_and_buffers_to_ignore)
    assert "0.weight_scale" not in model._ddp_params_and_buffers_to_ignore  # fp32, a few bytes: sent as usual


def test_flux_trains_its_lora_on_the_fp8_matmul(tmp_path, tiny_flux_path, mixed_data):
    """In process (the UNet families: the launcher test below). FLUX's first parameter belongs to a Linear the
    fp8 matmul takes, which diffusers' `dtype` (what its pipelines cast inputs to) must not report."""
    family, stream = make_family(tmp_path / "fp8", "flux", tiny_flux_path, mixed_data, *FP8, "model.fp8_compute=on")
    network = family.flow.transformer
    base = [m.base_layer for m in network.modules() if hasattr(m, "base_layer")]
    assert base and all(isinstance(m, Fp8Linear) for m in base)  # every adapted layer computes in fp8
    assert network.dtype == torch.float32  # diffusers' dtype (pipelines cast to it): not float8
    trained = [p for p in network.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)

    reference, ref_stream = make_family(tmp_path / "fp32", "flux", tiny_flux_path, mixed_data,
                                        "train.gradient_checkpointing=true")
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0)
    batch = [(p, *stream.item(p)) for p in stream.positions(0, 0, 0)]
    ref_batch = [(p, *ref_stream.item(p)) for p in ref_stream.positions(0, 0, 0)]
    first = reference.loss(ref_batch).item()
    losses = []
    for _ in range(4):
        loss = family.loss(batch)
        loss.backward()
        assert all(p.grad is not None for p in trained) and all(m.weight.grad is None for m in base)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert losses[0] == pytest.approx(first, rel=0.05) and losses[0] != first  # fp8, near the fp32 loss


@pytest.mark.slow
def test_the_tiny_sd_trains_on_the_fp8_matmul_through_the_launcher_on_two_processes(tmp_path, tiny_sd_path,
                                                                                     demo_data_path):
    """The real engine (launcher, torchrun, 2-process gloo DDP): the plan's choice reaches the workers, DDP leaves
    the float8 buffers alone, and the LoRA trains."""
    from tests.engine_helpers import engine_config, final_weights, launch, log_of
    from trainer.core.events import read_events

    config = engine_config(tiny_sd_path, demo_data_path, *FP8, "model.fp8_compute=on", "devices=cpu:2",
                           "train.steps=2", "checkpoint.every=2", "name=fp8")
    run_dir, final = launch(tmp_path, config)
    assert final["type"] == "done", log_of(run_dir)
    plan = next(e for e in read_events(run_dir) if e["type"] == "plan")
    assert plan["fp8_compute"] and "fp8 matmul" in plan["line"]
    lora = final_weights(run_dir)
    ups = [v for k, v in lora.items() if "lora_B" in k]
    assert ups and any(float(v.abs().max()) > 0 for v in ups)  # lora_B starts at zero: it moved
