"""`model.block_swap`: the last N transformer blocks keep their frozen weights in CPU memory and are copied in for each
call (forward, and the recompute of gradient checkpointing that the backward uses). On the CPU the same code path
copies CPU to CPU, so a swapped run must train exactly as an unswapped one. In process on the tiny FLUX model; the
launcher's 1 -> 2 process resume with swapped blocks is in tests/test_flux2.py."""

import contextlib

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


def test_block_swap_is_refused_with_its_reason(tmp_path):
    cases = {
        ("model.family=sd", "model.block_swap=4", "train.gradient_checkpointing=true"): "no run of identical blocks",
        ("model.family=flux", "model.block_swap=4"): "needs train.gradient_checkpointing=true",
        ("model.family=flux", "model.block_swap=4", "train.gradient_checkpointing=true",
         "method=full"): "is for LoRA",
        ("model.family=flux", "model.block_swap=-1"): "a number of blocks",
    }
    for overrides, reason in cases.items():
        with pytest.raises(ConfigError, match=reason):
            load_config(None, ["model.path=x", "data.path=y", *overrides], check_paths=False)
