"""`model.text_encoder_weights`: the frozen text encoders stored quantized while they fill the text cache (what lets
FLUX.2 dev's and Qwen-Image's encoders encode on a 12-24 GB card), through the same component as model.base_weights.
In process on the tiny FLUX.1 (CLIP-L and T5: the T5 is what the big families' encoders are, a stack of Linear
layers). The embeddings stay close to the unquantized ones (bounded here), and the LoRA trains on them."""

import pytest
import torch

from tests.test_base_weights import _losses
from tests.test_bucketing_families import make_family, mixed_data, models  # noqa: F401 (fixtures)
from trainer.core.config import load_config
from trainer.errors import ConfigError

# The worst relative error (L2 norm of the difference over the L2 norm) of a caption's embeddings, per mode, on the
# tiny model's random weights: measured 0.068 (fp8: 3 mantissa bits), 0.014 (int8: a scale per row), 0.20 (nf4: 16
# levels per 64 weights) through the tiny T5's 2 layers; bounded at 1.5x. Errors of this size on random weights,
# not a claim about the real encoders' (musubi-tuner and ai-toolkit ship fp8 / 4-bit encoders for these models).
BOUND = {"fp8": 0.1, "int8": 0.02, "nf4": 0.3}


def _embeddings(family) -> dict[str, torch.Tensor]:
    flow = family.flow
    return {f"{caption}/{k}": v.float() for caption in flow.data.captions()
            for k, v in flow.cached(caption).items()}


@pytest.mark.slow  # 4 tiny models loaded, 3 steps
def test_quantized_text_encoders_give_nearly_the_same_embeddings_and_the_lora_trains_on_them(
        tmp_path, models, mixed_data):
    reference, _ = make_family(tmp_path / "bf16", "flux", models["flux"], mixed_data)
    expected = _embeddings(reference)
    errors = {}
    for mode in BOUND:
        family, stream = make_family(tmp_path / mode, "flux", models["flux"], mixed_data,
                                     f"model.text_encoder_weights={mode}")
        t5 = family.flow.text_encoders[-1]
        linear = [m for name, m in t5.named_modules() if isinstance(m, torch.nn.Linear)
                  and not (mode == "fp8" and name.endswith(".wo"))]  # T5 keeps `wo` in full precision for fp8
        assert linear and all(type(m.weight.data) is not torch.Tensor or m.weight.dtype == torch.float8_e4m3fn
                              for m in linear), mode  # every Linear stored quantized
        got = _embeddings(family)
        assert got.keys() == expected.keys()
        errors[mode] = max(float((got[k] - expected[k]).norm() / expected[k].norm()) for k in got)
        assert 0 < errors[mode] < BOUND[mode], (mode, errors)
        if mode == "nf4":  # the coarsest: the LoRA still learns on its cached embeddings
            losses = _losses(family, stream, steps=3)
            assert losses[-1] < losses[0], losses
    assert errors["int8"] < errors["fp8"] < errors["nf4"], errors  # finer grids round less


def test_text_encoder_weights_are_refused_where_the_family_keeps_its_encoders_unquantized():
    with pytest.raises(ConfigError, match=r"model.text_encoder_weights: nf4 is for the flow-matching families; "
                                          r"sdxl keeps its text encoders unquantized"):
        load_config(None, ["model.family=sdxl", "model.text_encoder_weights=nf4", "model.path=x", "data.path=y"],
                    check_paths=False)
    config = load_config(None, ["model.family=qwenimage", "model.text_encoder_weights=nf4", "model.path=x",
                                "data.path=y"], check_paths=False)
    assert config.model.text_encoder_weights == "nf4"


def test_encoding_on_the_cpu_takes_the_encoders_out_of_the_gpu_plan_and_needs_the_text_cache(monkeypatch):
    """`model.text_encoder_device: cpu` (FLUX.2 dev on 12 GB: its Mistral fits no such card, even in NF4): the plan
    counts no encoder on the GPU, and the same preset encoding on the GPU finds nothing that fits. (On this CPU
    machine the run's device is the CPU, so the trainer's path is the one every CPU test takes.)"""
    from pathlib import Path

    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # a plan reads no model file
    preset = Path(__file__).resolve().parents[1] / "presets" / "flux2-dev-lora-12gb.yaml"
    plan = make_plan(load_config(preset, ["data.path=x"], check_paths=False), CPU_ONLY)
    assert "of 12 GB" in plan.memory and "while the text cache is built" not in plan.memory
    with pytest.raises(ConfigError, match=r"with all 56 blocks swapped the estimate still peaks at [\d.]+ GB while "
                                          r"the text cache is built.*model.text_encoder_device=cpu"):
        make_plan(load_config(preset, ["data.path=x", "model.text_encoder_device=auto",
                                       "model.text_encoder_weights=nf4"], check_paths=False), CPU_ONLY)
    with pytest.raises(ConfigError, match="model.text_encoder_device: cpu encodes the captions once, into the text "
                                          "cache, which this run turns off"):
        load_config(preset, ["data.path=x", "data.cache_text_embeddings=false"], check_paths=False)
    with pytest.raises(ConfigError, match="model.text_encoder_device: cpu is for the flow-matching families"):
        load_config(None, ["model.family=sdxl", "model.text_encoder_device=cpu", "model.path=x", "data.path=y"],
                    check_paths=False)
