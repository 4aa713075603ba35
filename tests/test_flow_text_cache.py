"""FLUX and SD3 encode every caption, sample prompt and negative prompt once into the disk text cache, then move
their text encoders off the GPU for good (T5-XXL is 9 GB in bf16): training steps and samples never call an
encoder again, a later run with the same captions and model reuses the cache without encoding, and the cached
embeddings give exactly the losses and samples the encoders themselves give. In process, on the tiny models."""

import numpy as np
import pytest
import torch

from tests.test_bucketing_families import batch, make_family, mixed_data  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

SAMPLES = ["sample.prompts=[a red circle, a green square]", "sample.steps=2", "sample.size=32",
           "sample.guidance_scale=2.0", "sample.negative_prompt=blurry"]


@pytest.fixture(scope="module")
def flow_models(tiny_flux_path, tiny_sd3_path):
    return {"flux": tiny_flux_path, "sd3": tiny_sd3_path}


def _forbid_encoders(family) -> list[str]:
    calls = []
    for name, encoder in zip(family.text_encoder_names, family.flow.text_encoders):
        encoder.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_captions_are_encoded_once_then_the_encoders_are_not_used(tmp_path, flow_models, mixed_data, name,
                                                                   monkeypatch):
    family, stream = make_family(tmp_path, name, flow_models[name], mixed_data, *SAMPLES)
    assert family.flow.text_cache is not None
    captions = {item.caption for item in family.flow.data.images}
    expected = captions | {"a red circle", "a green square"} | ({"blurry"} if name == "sd3" else set())
    assert set(family.flow.text_cache.index) == expected  # SD3's guidance also needs the negative prompt
    calls = _forbid_encoders(family)
    loss = family.loss(batch(stream, 0))
    images = [image for _, [image] in family.render_samples(step=1)]
    assert calls == [] and len(images) == 2

    # the encoders' own outputs give the same loss and the same samples
    direct, _ = make_family(tmp_path / "direct", name, flow_models[name], mixed_data, *SAMPLES,
                            "data.cache_text_embeddings=false")
    assert direct.flow.text_cache is None
    direct_calls = _forbid_encoders(direct)
    torch.testing.assert_close(loss, direct.loss(batch(stream, 0)))
    direct_images = [image for _, [image] in direct.render_samples(step=1)]
    assert direct_calls  # that path did use them
    for cached, encoded in zip(images, direct_images):
        assert np.abs(np.asarray(cached, dtype=np.int16) - np.asarray(encoded, dtype=np.int16)).max() <= 1

    # a second run over the same captions and model reads the cache from disk: no encoding at all
    family_class = type(family)
    monkeypatch.setattr(family_class, "encode_caption", lambda *_: pytest.fail("encoded again"))
    again, _ = make_family(tmp_path, name, flow_models[name], mixed_data, *SAMPLES)
    torch.testing.assert_close(again.loss(batch(stream, 0)), loss)


def test_a_prompt_outside_the_cache_brings_the_encoders_back_for_that_sample(tmp_path, flow_models, mixed_data):
    family, _ = make_family(tmp_path, "flux", flow_models["flux"], mixed_data, *SAMPLES)
    calls = _forbid_encoders(family)
    [image] = family.sample(["a prompt nobody cached"], [0], size=32, steps=2, guidance_scale=1.0)
    assert image.size == (32, 32) and calls  # encoded on the spot
