"""`model.block_swap`: the last N transformer blocks keep their frozen weights in CPU memory and are copied in for each
call (forward, and the recompute of gradient checkpointing that the backward uses). On the CPU the same code path
copies CPU to CPU, so a swapped run must train exactly as an unswapped one. In process on the tiny FLUX model; the
launcher's 1 -> 2 process resume with swapped blocks is in tests/test_flux2.py."""

import contextlib
from pathlib import Path

import pytest
import torch

from tests.test_base_weights import _losses
from tests.test_bucketing_families import make_family, mixed_data, models  # noqa: F401 (fixtures)
from trainer.core.config import load_config
from trainer.errors import ConfigError

SWAP = ["train.gradient_checkpointing=true"]


def _train(family, stream):
    return _losses(family, stream, steps=3)  # AdamW steps on one fixed batch (tests/test_base_weights.py)


@pytest.mark.slow  # 4 s on 2 cores
def test_swapped_blocks_train_exactly_as_resident_ones_and_are_copied_for_forward_and_recompute(
        tmp_path, models, mixed_data, monkeypatch):
    import trainer.families.flow.trainer as flow_trainer
    from trainer.families.components import base_weights, text_cache

    order = []  # the text encoders meet the device only while the transformer is parked in CPU memory
    real_parked, onload, offload = base_weights.parked, text_cache.onload, text_cache.offload

    @contextlib.contextmanager
    def parked(module, device, held=()):
        order.append(("park", len(held)))
        with real_parked(module, device, held):
            yield
        order.append("unpark")

    monkeypatch.setattr(flow_trainer, "parked", parked)
    monkeypatch.setattr(text_cache, "onload", lambda *a: (order.append("encoders in"), onload(*a)))
    monkeypatch.setattr(text_cache, "offload", lambda *a: (order.append("encoders out"), offload(*a)))
    swapped, stream = make_family(tmp_path / "swap", "flux", models["flux"], mixed_data, *SWAP, "model.block_swap=2")
    assert order == [("park", 2), "encoders in", "encoders out", "unpark"]
    resident, ref_stream = make_family(tmp_path / "ref", "flux", models["flux"], mixed_data, *SWAP)
    swap = swapped.flow.block_swap
    assert swap is not None and len(swap.stored) == 2
    single = swapped.flow.transformer.single_transformer_blocks
    stored = [param for _, _, param in swap.stored[-1]]
    assert stored and all(any(p is q for q in single[-1].parameters()) for p in stored)  # the last block's own
    assert any(p.requires_grad for p in single[-1].parameters())  # its LoRA trains (not stored)

    losses = _train(swapped, stream)
    assert losses == _train(resident, ref_stream)  # fp32: bit for bit
    assert losses[-1] < losses[0]
    # each step: one forward (under checkpointing, no weights kept) and one recompute per swapped block; the
    # copies: the first step's 2 + the prefetch for the recompute, then 2 a step (the last block's copy serves its
    # recompute, the first block's the next forward)
    assert swap.calls == 3 * 2 * 2 and swap.copies == 3 + 2 + 2
    trained = swapped.trainable_state()
    reference = resident.trainable_state()
    assert trained.keys() == reference.keys() and all(torch.equal(trained[k], reference[k]) for k in trained)
    # after the steps the blocks hold their stored Parameters again: what exporters and the state dict read
    assert all(any(p is q for q in single[-1].parameters()) for p in stored)


def _full_losses(family, stream, swap, steps=3, accumulation=2):
    """The loop's update on a full fine-tune: accumulated micro-steps, the swapped gradients averaged
    (`reduce_gradients`, a no-op on one process), clipping by the global norm, one AdamW, an EMA."""
    from diffusers.training_utils import EMAModel

    params = [p for g in family.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0, foreach=True)
    ema = EMAModel(params, decay=0.9)
    batch = [(p, *stream.item(p)) for p in stream.positions(0, 0, 0)]
    losses, norms = [], []
    for _ in range(steps):
        for micro in range(accumulation):
            loss = family.loss(batch[micro::accumulation])
            (loss / accumulation).backward()
            losses.append(float(loss.detach()))
        family.reduce_gradients()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))
        optimizer.step()
        ema.step(params)
        optimizer.zero_grad(set_to_none=True)
    return losses, norms, optimizer, ema


@pytest.mark.slow  # 6 s on 2 cores
def test_a_full_fine_tune_with_swapped_blocks_trains_its_cpu_held_blocks_exactly_as_resident_ones(
        tmp_path, models, mixed_data):
    """A full fine-tune keeps the swapped blocks' fp32 weights, gradients, AdamW state and EMA in CPU memory (on the
    CPU that is where everything is: what is checked is that they are the stored Parameters, copied in for each
    call and never trained through a stale copy). Accumulation, the clipping norm (every gradient in it: the clip
    binds) and EMA give exactly the unswapped run's numbers."""
    full = [*SWAP, "method=full", "train.lr=1e-3"]
    swapped, stream = make_family(tmp_path / "swap", "flux", models["flux"], mixed_data, *full, "model.block_swap=2")
    resident, ref_stream = make_family(tmp_path / "ref", "flux", models["flux"], mixed_data, *full)
    # The CPU's fp32 matmul depends on where a weight lies in memory: a loaded weight and its fresh copy differ by
    # 1 ulp on the second micro-batch's shape (measured; giving the reference's last two blocks fresh copies alone
    # made the runs agree). Both models get freshly allocated weights, as every swapped copy is.
    for family in (swapped, resident):
        for param in family.flow.transformer.parameters():
            param.data = param.data.clone()
    swap = swapped.flow.block_swap
    assert swap is not None and swap.trains
    held = swap.stored_trained()
    single = swapped.flow.transformer.single_transformer_blocks
    assert {id(p) for p in single[-1].parameters()} <= {id(p) for p in held}  # every weight of the last block

    losses, norms, optimizer, ema = _full_losses(swapped, stream, swap)
    ref_losses, ref_norms, _, _ = _full_losses(resident, ref_stream, None)
    assert min(norms) > 0.05  # the clip binds
    assert losses == ref_losses and norms == ref_norms  # fp32: bit for bit, the swapped gradients in the norm
    assert losses[-2:] != losses[:2]  # it trained through the swapped copies (the weights the 2nd pass saw changed)
    trained, reference = swapped.trainable_state(), resident.trainable_state()
    assert trained.keys() == reference.keys() and all(torch.equal(trained[k], reference[k]) for k in trained)
    # the optimizer state and the EMA of a held weight are of the stored Parameter, where it lives
    assert all(optimizer.state[p]["exp_avg"].device == p.device for p in held)
    assert all(s.device == p.device for s, p in zip(ema.shadow_params, optimizer.param_groups[0]["params"]))
    assert all(p.grad is None for p in held)
    # 3 steps x 2 micro-steps x (forward + recompute) x 2 blocks: no pass trained through a copy of the pass before
    assert swap.calls == 3 * 2 * 2 * 2 and swap.copies >= 3 * 2 * 2


def test_block_swap_is_refused_with_its_reason(tmp_path):
    cases = {
        ("model.family=sd", "model.block_swap=4", "train.gradient_checkpointing=true"): "no run of identical blocks",
        ("model.family=flux", "model.block_swap=4"): "needs train.gradient_checkpointing=true",
        ("model.family=flux", "model.block_swap=4", "train.gradient_checkpointing=true", "method=full",
         "distributed.sharding=fsdp"): "runs under DDP",
        ("model.family=flux", "model.block_swap=-1"): "a number of blocks",
    }
    for overrides, reason in cases.items():
        with pytest.raises(ConfigError, match=reason):
            load_config(None, ["model.path=x", "data.path=y", *overrides], check_paths=False)


@pytest.mark.slow  # 3 launcher runs of the tiny FLUX.1
def test_a_full_fine_tune_with_swapped_blocks_stopped_and_resumed_on_two_processes_matches_one_unswapped(
        tmp_path, tiny_flux_path):
    """Through the real launcher and loop: an EMA'd, clipped full fine-tune with 2 blocks' weights, gradients and
    AdamW state held in CPU memory, stopped at step 2 on one process and resumed on two (DDP averaging the resident
    gradients, `reduce_gradients` the held ones; the checkpoint carries the held blocks' optimizer state and EMA),
    gives the losses and weights of an uninterrupted unswapped run on one process."""
    from tests import flow_family_runs as flow_runs
    from tests.engine_helpers import log_of
    from trainer.families.sd.demo import make_demo_dataset

    data = make_demo_dataset(tmp_path / "data", count=4)
    demo = Path(__file__).resolve().parents[1] / "presets" / "demo-flux.yaml"
    full = ("method=full", "full.ema=true", "train.max_grad_norm=0.05", "train.gradient_checkpointing=true")
    reference = flow_runs.reference(tmp_path, demo, tiny_flux_path, data, *full)
    flow_runs.assert_resumed_on_two_processes_matches(reference, tmp_path, demo, tiny_flux_path, data, *full,
                                                      "model.block_swap=2")
    assert log_of(tmp_path / "stopped").count("2 blocks swapped") == 2  # the launch and the resume's plans
