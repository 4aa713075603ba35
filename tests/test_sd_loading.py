"""The real loading code paths users hit: a diffusers folder, a single-file checkpoint, a hub id offline."""

import pytest
import torch

from trainer.core.config.schema import ModelConfig
from trainer.errors import UserError
from trainer.families.components.ldm_checkpoint import save_single_file
from trainer.families.components.sd_loading import load_sd_components


def _unet_weights(components):
    return {k: v.clone() for k, v in components.unet.state_dict().items()}


def test_single_file_checkpoint_loads_like_its_diffusers_folder(tiny_sd_path, tmp_path):
    folder = load_sd_components(ModelConfig(path=str(tiny_sd_path)))
    single = save_single_file(tiny_sd_path, tmp_path / "tiny.safetensors", dtype=torch.float32)
    from_file = load_sd_components(ModelConfig(path=str(single), config=str(tiny_sd_path)))
    a, b = _unet_weights(folder), _unet_weights(from_file)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert from_file.prediction_type == folder.prediction_type == "epsilon"


def test_prediction_type_override_and_auto(tiny_sd_path):
    assert load_sd_components(ModelConfig(path=str(tiny_sd_path), prediction_type="v_prediction")).prediction_type \
        == "v_prediction"


def test_a_folder_that_is_not_a_model_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="Could not load the model at model.path"):
        load_sd_components(ModelConfig(path=str(tmp_path / "empty")))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="hub id is right and this machine has network"):
        load_sd_components(ModelConfig(path="no-such-org/no-such-model"))
