"""lora.type (LoRA, LoKr, LoHa), lora.dora, lora.factor and lora.init_from: every adapter trains in each diffusion
family, and its outputs reload to the trained weights.

Each case trains 3 optimizer steps in process on a tiny model, writes the family's outputs, and compares, module by
module, the trained adapted weights (base + what peft's layer adds) with:
- the kohya/ComfyUI file, applied with ComfyUI's formulas (comfy/weight_adapter/{lora,lokr,loha,base}.py, restated
  in `_comfy` below: the formulas, not ComfyUI's code, which is not installed);
- the peft folder through `PeftModel.from_pretrained` (LoKr, LoHa), or the diffusers file through
  `pipe.load_lora_weights` (DoRA).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainer.core.config import load_config
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.errors import ConfigError, UserError
from trainer.families import get_family
from trainer.families.components.adapters import adapter_layers, delta_weight
from trainer.families.components.kohya import clip_module_path, kohya_module_name
from trainer.families.protocol import WorkerContext


class _Accelerator:  # what a family uses of accelerate's, for one process
    def wait_for_everyone(self):
        pass


def family(tmp_path, name, model, data, *overrides):
    config = load_config(None, [f"model.path={model}", f"model.family={name}", f"data.path={data}", "precision=fp32",
                                "devices=cpu:1", "batch.total=2", "batch.per_device=2", "data.resolution=64",
                                "lora.rank=4", "lora.alpha=8", "name=run", *overrides])
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), lambda _: None, unwrap=lambda m: m)
    fam = get_family(name)(ctx)
    fam.load()
    fam.prepare_data()
    fam.set_prepared(fam.trainable_modules())
    return fam


def train(fam, steps=3, lr=1e-2):
    params = [p for g in fam.param_groups() for p in g["params"]]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0)
    for _ in range(steps):
        fam.loss([(0, 0, 0), (1, 0, 1)]).backward()
        optimizer.step()
        optimizer.zero_grad()


def adapted(model, adapter="default") -> dict[str, torch.Tensor]:
    """{module path: the weight the adapter makes of it}."""
    return {path: layer.get_base_layer().weight.detach().float() + delta_weight(layer, adapter)
            for path, layer in adapter_layers(model, adapter).items()}


def assert_weights(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys() and expected, what
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=2e-6,
                                   msg=lambda m: f"{what}, {name}: {m}")


def _comfy(tensors: dict, name: str, weight: torch.Tensor) -> torch.Tensor:
    """ComfyUI's weight for kohya module `name` on base `weight` (strength 1)."""
    def get(key):
        return tensors.get(f"{name}.{key}")

    alpha = get("alpha")
    if get("lora_down.weight") is not None:
        down, up = get("lora_down.weight"), get("lora_up.weight")
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * (alpha.item() / down.shape[0])
        scale = get("dora_scale")
        if scale is None:
            return weight + diff
        calc = weight + diff  # weight_decompose: output-axis scale -> the base weight's row norms
        if scale.shape[0] == weight.shape[0]:
            norm = weight.flatten(1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))
        else:
            norm = calc.transpose(0, 1).flatten(1).norm(dim=1, keepdim=True).transpose(0, 1)
        return calc * (scale / (norm + torch.finfo(weight.dtype).eps))
    if get("hada_w1_a") is not None:
        w1, w2 = get("hada_w1_a") @ get("hada_w1_b"), get("hada_w2_a") @ get("hada_w2_b")
        return weight + (w1 * w2).reshape(weight.shape) * (alpha.item() / get("hada_w1_b").shape[0])
    dim = None
    w1 = get("lokr_w1")
    if w1 is None:
        dim, w1 = get("lokr_w1_b").shape[0], get("lokr_w1_a") @ get("lokr_w1_b")
    w2 = get("lokr_w2")
    if w2 is None:
        dim, w2 = get("lokr_w2_b").shape[0], get("lokr_w2_a") @ get("lokr_w2_b")
    scale = alpha.item() / dim if alpha is not None and dim is not None else 1.0
    return weight + torch.kron(w1, w2).reshape(weight.shape) * scale


def assert_comfy_reproduces(file, models: dict) -> None:
    """`models`: {kohya name function: model}: every adapted module of each, through the file, ComfyUI's way."""
    tensors = load_file(str(file))
    names = set()
    for name_of, model in models.items():
        trained = adapted(model)
        bases = {p: layer.get_base_layer().weight.detach().float() for p, layer in adapter_layers(model).items()}
        got = {p: _comfy(tensors, name_of(p), bases[p]) for p in trained}
        assert_weights(got, trained, f"kohya file {file.name} through ComfyUI's formulas")
        names |= {name_of(p) for p in trained}
    assert {k.split(".")[0] for k in tensors} == names  # nothing else in the file


SD_NAMES = (lambda p: kohya_module_name(p, "lora_unet"),
            lambda p: kohya_module_name(clip_module_path(p), "lora_te"))
SD_CASES = {"lokr-full": ["lora.type=lokr", "lora.factor=4"], "lokr-low-rank": ["lora.type=lokr", "lora.rank=2"],
            "loha": ["lora.type=loha"], "dora": ["lora.dora=true"]}


# One case of each feature in the fast tier; the others train in process for ~10 s each (slow tier).
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c in ("loha", "dora") else [pytest.mark.slow])
                                  for c in SD_CASES])
def test_sd_adapters_train_and_their_files_reload_to_the_trained_weights(case, tmp_path, tiny_sd_path,
                                                                          demo_data_path):
    from diffusers import StableDiffusionPipeline
    from peft import PeftModel

    te = "false" if case == "dora" else "true"  # (DoRA refuses it: diffusers drops a text encoder's magnitudes)
    fam = family(tmp_path, "sd", tiny_sd_path, demo_data_path, f"lora.train_text_encoder={te}", *SD_CASES[case])
    before = adapted(fam.unet)
    train(fam)
    trained = adapted(fam.unet)
    assert any(not torch.equal(trained[p], before[p]) for p in trained)  # it trained
    outputs = fam.save_outputs(tmp_path / "output", step=3)
    kohya = next(p for p in map(__import__("pathlib").Path, outputs) if p.name.endswith("_kohya.safetensors"))
    assert_comfy_reproduces(kohya, dict(zip(SD_NAMES, (fam.unet, fam.text_encoder) if te == "true" else (fam.unet,))))
    with safe_open(str(kohya), "pt") as f:
        assert f.metadata()["ss_network_module"] == "lycoris.kohya"

    fresh = StableDiffusionPipeline.from_pretrained(tiny_sd_path, local_files_only=True)
    if case == "dora":
        fresh.load_lora_weights(tmp_path / "output")
        adapter = "default_0"
        assert_weights(adapted(fresh.unet, adapter), trained, "diffusers file")
    else:
        unet = PeftModel.from_pretrained(fresh.unet, str(tmp_path / "output" / "peft" / "unet")).base_model.model
        te = PeftModel.from_pretrained(fresh.text_encoder, str(tmp_path / "output" / "peft" / "text_encoder"))
        assert_weights(adapted(unet), trained, "peft folder")
        assert_weights(adapted(te.base_model.model), adapted(fam.text_encoder), "peft folder, text encoder")


def test_lokr_with_both_factors_full_is_unscaled_as_in_lycoris(tmp_path, tiny_sd_path, demo_data_path):
    full = family(tmp_path / "a", "sd", tiny_sd_path, demo_data_path, *SD_CASES["lokr-full"])
    low = family(tmp_path / "b", "sd", tiny_sd_path, demo_data_path, *SD_CASES["lokr-low-rank"])
    layer = next(iter(adapter_layers(full.unet).values()))
    assert "default" in layer.lokr_w2 and layer.scaling["default"] == 1.0  # alpha 8 / rank 4 would be 2
    layer = next(iter(adapter_layers(low.unet).values()))
    assert "default" in layer.lokr_w2_b and layer.scaling["default"] == 8 / 2


XL_NAMES = (lambda p: kohya_module_name(p, "lora_unet"),
            lambda p: kohya_module_name(clip_module_path(p), "lora_te1"),
            lambda p: kohya_module_name(clip_module_path(p), "lora_te2"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lokr", "dora"])
def test_sdxl_adapters_reload_lokr_with_both_text_encoders(case, tmp_path, tiny_sdxl_path, demo_data_path):
    from diffusers import StableDiffusionXLPipeline
    from peft import PeftModel

    extra = ["lora.type=lokr", "lora.train_text_encoder=true"] if case == "lokr" else ["lora.dora=true"]
    fam = family(tmp_path, "sdxl", tiny_sdxl_path, demo_data_path, *extra)
    train(fam)
    fam.save_outputs(tmp_path / "output", step=3)
    models = (fam.unet, fam.text_encoder, fam.text_encoder_2)[:3 if case == "lokr" else 1]
    assert_comfy_reproduces(tmp_path / "output" / "run_kohya.safetensors", dict(zip(XL_NAMES, models)))
    fresh = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_path, local_files_only=True)
    for component, model in zip(("unet", "text_encoder", "text_encoder_2"), models):
        if case == "dora":
            if component == "unet":
                fresh.load_lora_weights(tmp_path / "output")
            loaded = adapted(getattr(fresh, component), "default_0")
        else:
            peft = PeftModel.from_pretrained(getattr(fresh, component), str(tmp_path / "output" / "peft" / component))
            loaded = adapted(peft.base_model.model)
        assert_weights(loaded, adapted(model), f"{component}")


FLOW_CASES = {"flux-loha": ("flux", ["lora.type=loha"]), "flux-dora": ("flux", ["lora.dora=true"]),
              "sd3-lokr": ("sd3", ["lora.type=lokr", "lora.factor=4"])}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "flux-loha" else [pytest.mark.slow])
                                  for c in FLOW_CASES])
def test_flow_adapters_write_onetrainer_names_that_reload(case, tmp_path, tiny_flux_path, tiny_sd3_path,
                                                          demo_data_path):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from peft import PeftModel

    name, extra = FLOW_CASES[case]
    path, cls = (tiny_flux_path, FluxPipeline) if name == "flux" else (tiny_sd3_path, StableDiffusion3Pipeline)
    fam = family(tmp_path, name, path, demo_data_path, *extra)
    train(fam)
    transformer = fam.flow.transformer
    fam.save_outputs(tmp_path / "output", step=3)
    kohya = tmp_path / "output" / "run_kohya.safetensors"
    assert_comfy_reproduces(kohya, {lambda p: "lora_transformer_" + p.replace(".", "_"): transformer})
    fresh = cls.from_pretrained(path, local_files_only=True)
    if "dora" in case:
        fresh.load_lora_weights(tmp_path / "output")
        loaded = adapted(fresh.transformer, "default_0")
    else:
        loaded = adapted(PeftModel.from_pretrained(fresh.transformer,
                                                   str(tmp_path / "output" / "peft" / "transformer")).base_model.model)
    assert_weights(loaded, adapted(transformer), "reloaded transformer")


# ---- lora.init_from ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd_lora(tmp_path_factory, tiny_sd_path, demo_data_path):
    """A trained SD LoRA with its text encoder (rank 4, alpha 8) and its output files."""
    tmp = tmp_path_factory.mktemp("source")
    fam = family(tmp, "sd", tiny_sd_path, demo_data_path, "lora.train_text_encoder=true")
    train(fam)
    fam.save_outputs(tmp / "output", step=3)
    return fam, tmp / "output"


@pytest.mark.parametrize("source,dora", [("kohya", False), pytest.param("diffusers", False, marks=pytest.mark.slow),
                                         pytest.param("kohya", True, marks=pytest.mark.slow)])
def test_init_from_starts_at_the_files_update_whatever_its_format_and_alpha(source, dora, sd_lora, tmp_path,
                                                                              tiny_sd_path, demo_data_path):
    src, output = sd_lora
    file = output / "run_kohya.safetensors" if source == "kohya" else output  # a folder: its diffusers file
    if dora:  # a DoRA run adapts the UNet only: it starts from the file's UNet part
        file = tmp_path / "unet-only.safetensors"
        tensors = load_file(str(output / "run_kohya.safetensors"))
        save_file({k: v for k, v in tensors.items() if k.startswith("lora_unet_")}, str(file))
    fam = family(tmp_path, "sd", tiny_sd_path, demo_data_path, f"lora.train_text_encoder={str(not dora).lower()}",
                 "lora.alpha=2", f"lora.init_from={file}", f"lora.dora={str(dora).lower()}")
    assert_weights(adapted(fam.unet), adapted(src.unet), "unet start")
    if not dora:
        assert_weights(adapted(fam.text_encoder), adapted(src.text_encoder), "text encoder start")
    train(fam, steps=1)  # and it trains from there
    assert any(not torch.equal(a, b) for a, b in zip(adapted(fam.unet).values(), adapted(src.unet).values()))


@pytest.mark.slow
def test_init_from_a_dora_keeps_its_magnitudes(tmp_path, tiny_sd_path, demo_data_path):
    src = family(tmp_path / "src", "sd", tiny_sd_path, demo_data_path, "lora.dora=true")
    train(src)
    src.save_outputs(tmp_path / "out", step=3)
    fam = family(tmp_path / "new", "sd", tiny_sd_path, demo_data_path, "lora.dora=true",
                 f"lora.init_from={tmp_path / 'out'}")
    assert_weights(adapted(fam.unet), adapted(src.unet), "DoRA start")
    with pytest.raises(UserError, match="set lora.dora=true"):
        family(tmp_path / "plain", "sd", tiny_sd_path, demo_data_path, f"lora.init_from={tmp_path / 'out'}")
    with pytest.raises(UserError, match="kohya-format DoRA"):
        family(tmp_path / "k", "sd", tiny_sd_path, demo_data_path, "lora.dora=true",
               f"lora.init_from={tmp_path / 'out' / 'run_kohya.safetensors'}")


def test_init_from_names_every_mismatch_at_once(sd_lora, tmp_path, tiny_sd_path, demo_data_path):
    _, output = sd_lora
    with pytest.raises(UserError) as err:
        family(tmp_path, "sd", tiny_sd_path, demo_data_path, "lora.rank=8", "lora.unet_targets=[to_q]",
               f"lora.init_from={output}")
    message = str(err.value)
    assert "lora.train_text_encoder=true" in message and "set lora.rank=4" in message
    assert "layers this run does not, e.g." in message


@pytest.mark.slow
def test_flux_init_from_reads_its_diffusers_file(tmp_path, tiny_flux_path, demo_data_path):
    # (diffusers reads FLUX's fused BFL/kohya names with the full-size model's widths written into its converter,
    # so the tiny model can only show the diffusers-key path; the kohya path is the SD tests')
    src = family(tmp_path / "src", "flux", tiny_flux_path, demo_data_path)
    train(src)
    src.save_outputs(tmp_path / "out", step=3)
    fam = family(tmp_path / "new", "flux", tiny_flux_path, demo_data_path, "lora.alpha=1",
                 f"lora.init_from={tmp_path / 'out'}")
    assert_weights(adapted(fam.flow.transformer), adapted(src.flow.transformer), "FLUX start")


def test_bad_adapter_settings_are_all_named_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["lora.type=loha", "lora.dora=true", "lora.dropout=0.1", "lora.factor=4",
                           f"lora.init_from={tmp_path / 'missing.safetensors'}", "lora.ema=true",
                           "lora.ema_decay=1.5"])
    message = str(err.value)
    for expected in ("lora.factor: 4 splits LoKr", "lora.dora: DoRA decomposes a LoRA", "lora.dropout: 0.1",
                     "lora.init_from: starts a LoRA from a LoRA file", "lora.ema_decay: must be between 0 and 1"):
        assert expected in message
    with pytest.raises(ConfigError, match="drops a text encoder's DoRA magnitudes"):
        load_config(None, ["lora.dora=true", "lora.train_text_encoder=true"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, [f"lora.init_from={tmp_path / 'missing.safetensors'}"])
    with pytest.raises(ConfigError, match="model.base_weights=fp8 does not keep"):
        load_config(None, ["lora.dora=true", "model.base_weights=fp8", "train.gradient_checkpointing=true"])
