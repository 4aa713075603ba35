"""Caption augmentation (`data.caption_prefix`, `caption_dropout`, `shuffle_tags`, `keep_tokens`): the caption a
sample trains on is a pure function of (seed, stream position, its caption), so the same on 1 or N processes and
after a resume; dropout drops the stated fraction; the text caches hold exactly what can be cached (prefixed
captions and the empty one) and a run that shuffles encodes per step instead of using stale embeddings."""

from pathlib import Path

import torch

from tests.security_helpers import image_folder
from tests.test_captioned_latents import _VAE, _Accelerator
from trainer.core.config import load_config
from trainer.core.data.captions import CaptionAugment, split_tags
from trainer.core.data.stream import BatchStream
from trainer.core.hardware import CPU_ONLY
from trainer.core.plan import make_plan
from trainer.errors import ConfigError
from trainer.families.protocol import Sample, WorkerContext

TAGS = "sks, red circle, white background, centered, small, photo"


def _tagged(folder: Path, count: int = 4) -> Path:
    image_folder(folder, count)
    for n in range(count):
        (folder / f"img{n}.txt").write_text(f"{TAGS}, tag{n}")
    return folder


def _context(tmp_path, config):
    warnings: list[str] = []
    ctx = WorkerContext(config, make_plan(config, CPU_ONLY), tmp_path / "run", tmp_path / "cache",
                        torch.device("cpu"), 0, 1, _Accelerator(), warnings.append, unwrap=lambda module: module)
    return ctx, warnings


def _data(tmp_path, *overrides):
    from trainer.families.components.captioned_latents import CaptionedLatents

    config = load_config(None, ["model.path=stand-in/model", f"data.path={_tagged(tmp_path / 'data')}",
                                "data.resolution=32", "precision=fp32", "devices=cpu:1", "batch.total=4",
                                *overrides], check_paths=False)
    data = CaptionedLatents(_context(tmp_path, config)[0], _VAE())
    data.prepare()
    return data


def test_dropout_drops_the_stated_fraction_and_shuffling_keeps_the_leading_tags(tmp_path):
    data = _data(tmp_path, "data.caption_dropout=0.2", "data.shuffle_tags=true", "data.keep_tokens=2",
                 "data.caption_prefix=style of", "data.val_split=0.25")
    assert len(data.images) == 3 and len(data.held_out) == 1
    n = 20000
    captions = [data.row_caption((p, 0, p % 3, p % 3, "instance")) for p in range(n)]
    dropped = captions.count("")
    assert abs(dropped - 0.2 * n) < 4 * (n * 0.2 * 0.8) ** 0.5  # 4 sigma of the binomial
    kept = [c for c in captions if c]
    for position, caption in enumerate(captions[:200]):
        if not caption:
            continue
        assert caption.startswith("style of sks, red circle, ")  # the prefix, then the kept tags in place
        own = data.images[position % 3].caption
        assert sorted(split_tags(caption.removeprefix("style of "))) == sorted(split_tags(own))
    assert len(set(kept)) > 100  # the other tags really move
    # a held-out image keeps its caption, with the prefix, at every position
    held = "style of " + data.held_out[0].caption
    assert {data.row_caption((p, 0, 0, 0, "val")) for p in range(50)} == {held} and held in data.captions()
    plain = CaptionAugment(shuffle=True, keep_tokens=2)
    with_dropout = CaptionAugment(shuffle=True, keep_tokens=2, dropout=0.2)
    same = [plain.draw(TAGS, seed=0, position=p) == with_dropout.draw(TAGS, seed=0, position=p) or
            with_dropout.draw(TAGS, seed=0, position=p) == "" for p in range(500)]
    assert all(same)  # the coin is drawn first: a kept sample's shuffle does not depend on the dropout rate


def test_the_caption_of_a_position_is_the_same_on_one_or_two_processes_and_after_a_resume(tmp_path):
    overrides = ("data.caption_dropout=0.3", "data.shuffle_tags=true", "data.keep_tokens=1")
    data = _data(tmp_path, *overrides)
    seen: dict[int, dict[int, str]] = {}
    for world, per_device in ((1, 4), (2, 2), (2, 1)):
        stream = BatchStream(len(data.expanded), total=4, per_device=per_device, world_size=world, seed=0)
        captions = {}
        for step in range(6):
            for micro in range(stream.accumulation):
                for rank in range(world):
                    samples = [Sample(p, *stream.item(p)) for p in stream.positions(step, micro, rank)]
                    instance, _ = data.rows(samples)
                    captions.update({row[0]: data.row_caption(row) for row in instance})
        seen[world * 10 + per_device] = captions
    assert seen[14] == seen[22] == seen[21] and len(seen[14]) == 24
    resumed = _data(tmp_path / "resumed", *overrides)  # a new process: nothing carried over but the config
    assert {p: resumed.row_caption((p, *row[1:])) for p, row in
            ((p, (p, 0, p % 4, p % 4, "instance")) for p in range(8, 24))} == \
        {p: data.row_caption((p, 0, p % 4, p % 4, "instance")) for p in range(8, 24)}
    other_seed = _data(tmp_path / "seed", *overrides, "seed=1")
    assert [other_seed.row_caption((p, 0, 0, 0, "instance")) for p in range(20)] != \
        [data.row_caption((p, 0, 0, 0, "instance")) for p in range(20)]


def test_bad_values_are_refused_naming_the_key():
    def problems(*overrides):
        try:
            load_config(None, ["model.path=x/y", "data.path=x", *overrides], check_paths=False)
        except ConfigError as exc:
            return exc.problems
        return []

    assert problems("data.caption_dropout=0.1", "data.shuffle_tags=true", "data.keep_tokens=1") == []
    assert problems("data.caption_dropout=1.0")[0].startswith("data.caption_dropout: must be a probability in [0, 1)")
    assert problems("data.keep_tokens=2")[0].startswith("data.keep_tokens: 2 keeps tags in place while")
    assert problems("data.keep_tokens=-1", "data.shuffle_tags=true")[0].startswith("data.keep_tokens: must be zero")
    assert problems("data.shuffle_tags=true", "data.cache_text_embeddings=true")[0].startswith(
        "data.cache_text_embeddings: true cannot hold the captions of data.shuffle_tags")


def _family(tmp_path, name, model, *overrides):
    from trainer.families import get_family

    config = load_config(None, [f"model.path={model}", f"model.family={name}",
                                f"data.path={_tagged(tmp_path / 'data')}", "precision=fp32", "devices=cpu:1",
                                "batch.total=2", "batch.per_device=2", "data.resolution=64", "lora.rank=4",
                                *overrides])
    ctx, warnings = _context(tmp_path, config)
    family = get_family(name)(ctx)
    family.load()
    family.prepare_data()
    family.set_prepared(family.trainable_modules())
    return family, warnings


def test_sdxl_caches_the_prefixed_captions_and_the_empty_one_and_never_encodes_while_training(
        tmp_path, tiny_sdxl_path):
    family, _ = _family(tmp_path, "sdxl", tiny_sdxl_path, "data.caption_dropout=0.5", "data.caption_prefix=photo,")
    cache = family.text_embeddings
    assert cache is not None and "" in cache and f"photo, {TAGS}, tag0" in cache and f"{TAGS}, tag0" not in cache
    hidden, pooled = family.encode_prompts([""])
    torch.testing.assert_close(cache.get("")["hidden"], hidden[0].float())
    torch.testing.assert_close(cache.get("")["pooled"], pooled[0].float())
    calls = []
    for encoder in (family.text_encoder, family.text_encoder_2):
        encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    samples = [Sample(p, 0, p % 4) for p in range(8)]
    drawn = [family.data.row_caption(r) for r in family.data.rows(samples)[0]]
    assert "" in drawn and f"photo, {TAGS}, tag1" in drawn  # seed 0 drops some of these and keeps others
    with torch.no_grad():
        for k in range(0, 8, 2):
            assert torch.isfinite(family.loss(samples[k:k + 2]))
    assert calls == []  # every caption, dropped or not, came from the cache


def test_flux_encodes_shuffled_captions_at_every_step_and_keeps_none(tmp_path, tiny_flux_path):
    family, warnings = _family(tmp_path, "flux", tiny_flux_path, "flow.max_sequence_length=16",
                               "data.shuffle_tags=true", "data.keep_tokens=1")
    flow = family.flow
    assert flow.text_cache is None
    assert any("data.cache_text_embeddings is off because data.shuffle_tags" in w for w in warnings)
    encoded, text = [], flow._text
    flow._text = lambda captions: (encoded.extend(captions), text(captions))[1]
    samples = [Sample(p, 0, p % 4) for p in range(4)]
    with torch.no_grad():
        assert torch.isfinite(family.loss(samples[:2])) and torch.isfinite(family.loss(samples[2:]))
    assert encoded == [flow.data.sources[0].augment.draw(f"{TAGS}, tag{p}", seed=0, position=p) for p in range(4)]
    assert all(c.startswith("sks, ") for c in encoded) and encoded[0] != f"{TAGS}, tag0"
    assert flow.text_embeddings == {}  # nothing piles up per caption


def test_the_text_cache_is_off_only_where_captions_are_shuffled():
    from trainer.families.components.text_cache import cache_text_embeddings

    def config(*overrides):
        return load_config(None, ["model.path=x/y", "data.path=x", *overrides], check_paths=False)

    said: list[str] = []
    assert cache_text_embeddings(config("data.caption_dropout=0.1", "data.caption_prefix=a"), True, said.append)
    assert not cache_text_embeddings(config("data.shuffle_tags=true"), True, said.append)
    assert not cache_text_embeddings(config("data.shuffle_tags=true"), False, said.append)
    assert len(said) == 1 and "encoded at every step" in said[0]


def test_sd_trains_on_the_drawn_captions_and_keeps_no_token_ids_of_shuffled_ones(tmp_path, tiny_sd_path):
    family, _ = _family(tmp_path, "sd", tiny_sd_path, "data.shuffle_tags=true", "data.caption_dropout=0.5")
    seen = []
    family._predict = lambda noisy, t, captions, modules: (seen.extend(captions), noisy)[1]
    samples = [Sample(p, 0, p % 4) for p in range(6)]
    family.loss(samples[:2]), family.loss(samples[2:4]), family.loss(samples[4:])
    expected = [family.data.sources[0].augment.draw(f"{TAGS}, tag{p % 4}", seed=0, position=p) for p in range(6)]
    assert seen == expected and "" in seen and len(set(seen)) > 2
    del family._predict
    with torch.no_grad():
        family.loss(samples[:2])
    assert family.tokens == {}
