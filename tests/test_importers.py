"""launch.py --import-kohya / --import-ai-toolkit: other trainers' configs -> presets that pass --dry-run.

The fixtures (tests/fixtures/importers/) have the shapes of the real files: a kohya_ss GUI save of an SDXL LoRA
(as kohya_ss' test/config/*.json), an sd-scripts FLUX.1 LoRA config with its dataset TOML (sd-scripts'
docs/flux_train_network.md arguments), and ai-toolkit's FLUX LoRA example job. IMAGES and MODELS in them are
replaced by folders each test makes, since a preset's paths must exist to pass --dry-run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from trainer.core.config import load_config

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "importers"


# The imported configs are GPU configs (AdamW8bit, fp8 base weights): the import and --dry-run run as on a machine
# with one H100 and bitsandbytes, the hardware probe stood in for at interpreter start (sitecustomize).
GPU_MACHINE = """
import trainer.core.hardware as hardware
hardware.probe_in_subprocess = lambda timeout_s=180: hardware.Hardware(
    gpu_count=1, gpu_names=("NVIDIA H100",), gpu_memory_gb=(80.0,), bf16=True, gpu_capability=(9.0,),
    xformers=True, bitsandbytes=True, cpu_count=16)
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "gpu_machine").mkdir(exist_ok=True)
    (cwd / "gpu_machine" / "sitecustomize.py").write_text(GPU_MACHINE)
    # The fixtures name hub ids, which HF_HUB_OFFLINE=1 refuses (as it should); --dry-run only checks their form,
    # and any hub request would go to a closed port on this machine, never to the hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "PYTHONPATH": os.pathsep.join([str(cwd / "gpu_machine"), str(REPO)])}
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def _images(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    for n in range(count):
        Image.new("RGB", (64, 64), (40 * n, 90, 160)).save(folder / f"{n}.png")
        (folder / f"{n}.txt").write_text(f"tag{n}, a photo")
    return folder


def _fixture(name: str, tmp_path: Path, **tokens: Path) -> Path:
    text = (FIXTURES / name).read_text()
    for token, path in tokens.items():
        text = text.replace(token, str(path))
    (tmp_path / name).write_text(text)
    return tmp_path / name


def _import_then_dry_run(flag: str, source: Path, tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / "imported.yaml"
    imported = _cli(flag, str(source), "--out", str(out), cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert f"ready: python launch.py --preset {out} --dry-run" in imported.stdout, imported.stdout
    dry = _cli("--preset", str(out), "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "plan:" in dry.stdout
    return yaml.safe_load(out.read_text()), imported.stdout


@pytest.mark.slow
def test_a_kohya_ss_gui_sdxl_lora_imports_to_a_preset_that_passes_dry_run(tmp_path):
    images = tmp_path / "train"
    _images(images / "5_character", 4)
    source = _fixture("kohya_ss_sdxl_lora.json", tmp_path, IMAGES=images)
    preset, printed = _import_then_dry_run("--import-kohya", source, tmp_path)
    assert preset["model"] == {"family": "sdxl", "path": "stabilityai/stable-diffusion-xl-base-1.0"}
    assert preset["lora"] == {"rank": 32, "alpha": 16.0, "train_text_encoder": True}
    train = preset["train"]
    assert (train["lr"], train["text_encoder_lr"], train["optimizer"], train["scheduler"]) == \
        (1e-4, 5e-5, "adamw8bit", "cosine")
    assert (train["weight_decay"], train["betas"], train["min_snr_gamma"]) == (0.01, [0.9, 0.99], 5.0)
    # 10 epochs of 4 images x 5 repeats at batch 2: 100 steps; the GUI's lr_warmup is a percentage of them.
    assert (train["steps"], train["warmup_steps"]) == (100, 10)
    assert preset["batch"] == {"total": 2, "per_device": 2}
    assert preset["data"]["path"] == str(images) and preset["data"]["resolution"] == 1024
    assert (preset["data"]["shuffle_tags"], preset["data"]["keep_tokens"]) == (True, 1)  # the GUI's "1", a number
    assert preset["logging"] == {"tensorboard": True} and preset["attention"] == "sdpa"
    # Keys that change training but have no equivalent are listed with why, in the output and the file.
    for key in ("conv_dim = 64", "multires_noise_iterations = 8"):
        assert key in printed and key in (tmp_path / "imported.yaml").read_text()
    assert load_config(tmp_path / "imported.yaml", check_paths=False).name == "sdxl-character"


@pytest.mark.slow
def test_an_sd_scripts_flux_toml_with_its_dataset_config_imports_to_a_preset_that_passes_dry_run(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "flux1-dev.safetensors").write_bytes(b"stand-in: --dry-run checks the file is there, not its weights")
    images = _images(tmp_path / "style", 3)
    _fixture("sd_scripts_flux_dataset.toml", tmp_path, IMAGES=images)
    source = _fixture("sd_scripts_flux_lora.toml", tmp_path, MODELS=models)
    preset, printed = _import_then_dry_run("--import-kohya", source, tmp_path)
    assert preset["model"] == {"family": "flux", "path": str(models / "flux1-dev.safetensors"),
                               "config": "black-forest-labs/FLUX.1-dev", "base_weights": "fp8", "block_swap": "auto"}
    assert preset["lora"] == {"rank": 16, "alpha": 1.0}
    assert preset["flow"] == {"shift": 3.1582, "guidance": 1.0}
    train = preset["train"]
    assert (train["steps"], train["warmup_steps"], train["optimizer"], train["scheduler"]) == \
        (1600, 50, "adamw8bit", "constant")
    assert preset["data"]["datasets"] == [{"path": str(images), "repeats": 10, "instance_prompt": "sks style"}]
    # keep_tokens does nothing in kohya without shuffle_caption, and imagetune refuses that pair: left out.
    assert (preset["data"]["resolution"], preset["data"]["bucketing"], "keep_tokens" in preset["data"]) == \
        (1024, True, False)
    assert preset["checkpoint"] == {"every": 400} and preset["precision"] == "bf16"
    for key in ("subsets[0].color_aug = True", "clip_l = ", "t5xxl = ", "ae = "):
        assert key in printed, key
    # sd-scripts' 18 swapped block units: the plan picks how many of FLUX.1's blocks fit (model.block_swap auto)
    assert preset["model"]["block_swap"] == "auto" and preset["train"]["gradient_checkpointing"] is True


@pytest.mark.slow
def test_an_ai_toolkit_flux_job_imports_to_a_preset_that_passes_dry_run(tmp_path):
    images = _images(tmp_path / "person", 3)
    source = _fixture("ai_toolkit_flux_lora.yaml", tmp_path, IMAGES=images)
    preset, printed = _import_then_dry_run("--import-ai-toolkit", source, tmp_path)
    assert preset["model"] == {"family": "flux", "path": "black-forest-labs/FLUX.1-dev", "base_weights": "fp8"}
    assert preset["lora"] == {"rank": 16, "alpha": 16.0, "ema": True, "ema_decay": 0.99}
    assert preset["data"]["datasets"] == [{"path": str(images), "caption_extension": ".txt", "caption_dropout": 0.05}]
    assert preset["data"]["caption_prefix"] == "p3r5on,"
    assert preset["sample"]["prompts"][0] == "p3r5on holding a sign that says 'I LOVE PROMPTS!'"
    assert (preset["train"]["steps"], preset["checkpoint"]) == (2000, {"every": 250, "keep": 4})
    assert "noise_scheduler" not in printed  # the family's own objective: nothing lost, not listed


def test_ai_toolkits_quantize_maps_to_base_weights_fp8_and_its_absence_to_unquantized_bf16(tmp_path):
    from trainer.core.importers.ai_toolkit import read_ai_toolkit

    text = (FIXTURES / "ai_toolkit_flux_lora.yaml").read_text()
    for quantize, base in (("true", "fp8"), ("false", "bf16")):
        (tmp_path / "job.yaml").write_text(text.replace("quantize: true", f"quantize: {quantize}"))
        assert read_ai_toolkit(tmp_path / "job.yaml").get("model.base_weights") == base


def test_what_cannot_be_imported_is_one_clear_error_and_exit_2(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "wan.yaml").write_text("job: extension\nconfig:\n  process:\n    - model: {arch: 'wan21:1b'}\n")
    (tmp_path / "dataset.toml").write_text("[[datasets]]\nresolution = 512\n")
    cases = [("--import-kohya", "broken.json", "not valid JSON"),
             ("--import-kohya", "missing.toml", "is not a file"),
             ("--import-kohya", "dataset.toml", "dataset config"),
             ("--import-ai-toolkit", "wan.yaml", "trains wan21, which is not a model imagetune trains")]
    for flag, name, message in cases:
        result = _cli(flag, name, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.imagetune.yaml"))  # nothing half-written


def test_a_preset_with_what_is_missing_is_still_written_and_names_it(tmp_path):
    source = _fixture("kohya_ss_sdxl_lora.json", tmp_path, IMAGES=tmp_path / "not-here")
    result = _cli("--import-kohya", str(source), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "kohya_ss_sdxl_lora.imagetune.yaml"
    assert "still to set before it runs:" in result.stdout and "data.path" in result.stdout
    assert "set train.steps" in result.stdout  # 10 epochs of images that are not there: no step count
    assert "# Still to set" in out.read_text()
    again = _cli("--import-kohya", str(source), cwd=tmp_path)  # the default name is never overwritten
    assert again.returncode == 2 and "--out" in again.stderr


def test_sd_scripts_lycoris_regularization_and_loss_settings_map_to_their_keys(tmp_path):
    from trainer.core.importers.kohya import read_kohya

    (tmp_path / "prompts.txt").write_text("a sks dog on a beach --w 1024 --h 1024 --s 28\n# a comment\n\n")
    (tmp_path / "lokr.toml").write_text(f"""
pretrained_model_name_or_path = "stabilityai/stable-diffusion-xl-base-1.0"
sdxl_no_half_vae = true
network_module = "lycoris.kohya"
network_args = ["algo=lokr", "factor=8", "preset=attn-mlp"]
network_dim = 100000
network_alpha = 1
network_train_unet_only = true
train_data_dir = "{tmp_path / 'img'}"
reg_data_dir = "{tmp_path / 'reg'}"
prior_loss_weight = 0.5
loss_type = "huber"
huber_c = 0.2
optimizer_type = "Lion"
optimizer_args = ["weight_decay=0.1", "d_coef=2"]
lr_scheduler = "cosine_with_restarts"
lr_scheduler_num_cycles = 3
lr_warmup_steps = 0.1
max_train_steps = 500
log_with = "wandb"
log_tracker_name = "my-loras"
sample_prompts = "{tmp_path / 'prompts.txt'}"
sample_every_n_steps = 100
multires_noise_iterations = 6
""")
    imported = read_kohya(tmp_path / "lokr.toml")
    p = imported.preset
    assert p["model"]["family"] == "sdxl" and any("inferred" in n for n in imported.notes)
    assert p["lora"] == {"type": "lokr", "rank": 100000, "alpha": 1.0, "factor": 8}  # no text encoder: unet only
    assert p["data"]["datasets"] == [{"path": str(tmp_path / "img")},
                                     {"path": str(tmp_path / "reg"), "is_regularization": True}]
    assert p["prior"] == {"loss_weight": 0.5}
    t = p["train"]
    assert (t["loss"], t["huber_delta"], t["weight_decay"], t["scheduler"], t["scheduler_cycles"]) == \
        ("huber", 0.2, 0.1, "cosine_with_restarts", 3)
    assert t["warmup_steps"] == 50 and "optimizer" not in t  # a fraction of 500 steps; Lion: adamw, listed
    assert p["sample"] == {"every": 100, "prompts": ["a sks dog on a beach"]}
    assert p["logging"] == {"wandb": "my-loras"}
    unmapped = dict(imported.unmapped)
    assert {"optimizer_type = 'Lion'", "optimizer_args = 'd_coef=2'", "network_args = 'preset=attn-mlp'",
            "multires_noise_iterations = 6"} <= set(unmapped)
