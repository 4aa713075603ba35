"""train.noise_offset reaches every diffusion family: a per-channel shift of each sample's noise, drawn from
the sample's own generator after its other draws (so runs without it draw exactly what they drew before)."""

import pytest
import torch

from tests.engine_helpers import engine_config, launch, log_of, progress
from trainer.families.components import flow_matching as fm
from trainer.families.components import noise


def _generator():
    return torch.Generator().manual_seed(1234)


def test_flow_matching_noise_offset_shifts_each_channel_and_leaves_other_draws_alone():
    shape = (4, 8, 8)
    kwargs = dict(scheme="logit_normal", logit_mean=0.0, logit_std=1.0, shift=3.0)
    eps0, sigma0, noise0 = fm.draw_sample(_generator(), shape, **kwargs)
    eps1, sigma1, noise1 = fm.draw_sample(_generator(), shape, noise_offset=0.1, **kwargs)
    assert torch.equal(eps0, eps1) and sigma0 == sigma1
    shift = noise1 - noise0
    assert shift.abs().sum() > 0
    torch.testing.assert_close(shift, shift[:, :1, :1].expand(shape))  # one value per channel
    assert torch.equal(fm.draw_sample(_generator(), shape, noise_offset=0.0, **kwargs)[2], noise0)


def test_unet_noise_offset_is_the_same_rule():
    plain = noise.draw(_generator(), (4, 8, 8), num_timesteps=1000, noise_offset=0.0)
    offset = noise.draw(_generator(), (4, 8, 8), num_timesteps=1000, noise_offset=0.1)
    shift = offset.noise - plain.noise
    assert shift.abs().sum() > 0 and torch.allclose(shift, shift[:, :1, :1].expand(4, 8, 8))


@pytest.mark.slow
def test_a_flux_run_trains_with_the_noise_offset(tmp_path, tiny_flux_path, demo_data_path):
    """Through the launcher: the same one-step run with and without the offset reports a different loss (it
    was silently ignored by SD3 and FLUX before)."""
    losses = {}
    for offset in (0.0, 0.5):
        config = engine_config(tiny_flux_path, demo_data_path, "model.family=flux", "devices=cpu:1",
                               "train.steps=1", "flow.max_sequence_length=16", f"train.noise_offset={offset}",
                               f"name=offset-{offset}")
        run_dir, final = launch(tmp_path, config)
        assert final["type"] == "done", log_of(run_dir)
        losses[offset] = progress(run_dir)[0]["loss"]
    assert losses[0.0] != losses[0.5]
