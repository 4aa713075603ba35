"""The input pipeline (trainer.engine.input) and the per-rank telemetry (trainer.core.telemetry).

Workers change where a micro-batch is made, never what it is: the same tensors with 0 or 2 worker processes,
from the start or from a resumed step, for the diffusion data (decoded, cropped and flipped pixels; cached
latents) and for detection (decoded, augmented images and boxes), and the loss of what a worker fetched equals
the loss the family computes itself. A whole run resumed with workers is in test_engine
(`test_stopped_then_resumed_on_another_process_count_matches`), the telemetry of a real two-process run with a
slow rank in `test_two_processes_with_accumulation_match_one_process`.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_captioned_latents import _latents, data  # noqa: F401 -- `data` is a fixture used below
from tests.test_detection import make_family, shapes  # noqa: F401 -- `shapes` is a fixture used below
from trainer.core.config import load_config
from trainer.core.config.load import ConfigError
from trainer.core.data.stream import BatchStream
from trainer.core.hardware import Hardware
from trainer.core.plan import make_plan
from trainer.engine.input import InputPipeline, pack, unpack
from trainer.core.telemetry import FIELDS, lagging_rank, summarize


def _batches(pipeline: InputPipeline, start: int = 0) -> list:
    cpu = torch.device("cpu")
    return [(b.step, b.micro, [tuple(s) for s in b.samples], b.fetched_on(cpu)) for b in pipeline.from_step(start)]


def _assert_same(a, b) -> None:
    """Equal structures of tensors, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_a_workers_micro_batch_crosses_as_one_buffer_and_comes_back_exact():
    """What a worker fetched travels as one byte buffer (one shared-memory segment, one pin, one copy to the GPU)
    and comes back as the same tensors: every dtype, empty and 0-d tensors, non-contiguous ones, and the
    structure around them."""
    fetched = [{"latents": torch.randn(4, 8, 8), "ids": torch.arange(77), "mask": torch.rand(3, 3) > 0.5,
                "half": torch.randn(5).bfloat16(), "none": torch.empty(0, 4), "scalar": torch.tensor(2.5),
                "strided": torch.randn(6, 4).t(), "caption": "a photo"}, (torch.tensor([1, 2], dtype=torch.uint8), 3)]
    places, buffer = pack(fetched)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    _assert_same(unpack(places, buffer), fetched)


class _Family:
    """CaptionedLatents as the diffusion families hold it: `fetch` and `fetched` are theirs."""

    def __init__(self, latents):
        self.data = latents

    def fetch(self, samples):
        return self.data.fetch(samples)

    def loss_of(self, samples, fetched):
        raise AssertionError("the pipeline only fetches")


@pytest.mark.parametrize("cached", [False, True])
def test_workers_make_the_same_diffusion_micro_batches_from_any_step(tmp_path, data, cached):  # noqa: F811
    # Uncached: random crops and flips decoded in the workers; cached: rows of the latent cache.
    overrides = ["data.flip=true"] + ([] if cached else ["data.center_crop=false"])
    latents, count, _ = _latents(tmp_path, data, *overrides)
    assert (latents.latents is not None) == cached
    stream = BatchStream(count, total=2, per_device=1, world_size=1, seed=7)

    def pipeline(workers):
        return InputPipeline(stream, _Family(latents), rank=0, steps=4, accumulation=2, workers=workers, pin=False)

    inline, workers = _batches(pipeline(0)), _batches(pipeline(2))
    assert [(s, m) for s, m, _, _ in inline] == [(s, m) for s in range(4) for m in range(2)]
    # a worker's micro-batch crossed as one buffer (what the loop unpacks), the training thread's as it was made
    assert all(b.packed is not None for b in pipeline(2).from_step(3))
    assert all(b.packed is None for b in pipeline(0).from_step(3))
    _assert_same(inline, workers)
    _assert_same(inline[4:], _batches(pipeline(2), start=2))  # a resumed run continues with the same batches
    kinds = {tuple(f.keys()) for *_, fetched in inline for f in fetched}
    assert kinds == ({("mean", "std")} if cached else {("pixels",)})

    # What the step computes from a worker's fetch equals what it computes without one, and reads no file again.
    for _, _, samples, fetched in workers:
        rows = latents.rows(samples)[0]
        plain = [latents.latent_dist(row[2], row[1], row[3], row[4]) for row in rows]
        with latents.fetched(samples, fetched), pytest.MonkeyPatch.context() as patch:
            patch.setattr(latents, "_latent_source", lambda *a: pytest.fail("fetched again on the training thread"))
            via_worker = [latents.latent_dist(row[2], row[1], row[3], row[4]) for row in rows]
        _assert_same(plain, via_worker)


def test_workers_make_the_same_detection_micro_batches_and_losses(shapes, tmp_path):  # noqa: F811
    family = make_family(shapes, "fcos_tiny", tmp_path, "detection.augment=[color,zoom_out]")
    stream = BatchStream(family.items, total=2, per_device=2, world_size=1, seed=3)

    def pipeline(workers):
        return InputPipeline(stream, family, rank=0, steps=3, accumulation=1, workers=workers, pin=False)

    inline, workers = _batches(pipeline(0)), _batches(pipeline(2))
    _assert_same(inline, workers)
    _assert_same(inline[1:], _batches(pipeline(2), start=1))
    torch.manual_seed(0)
    for _, _, samples, fetched in workers:
        assert torch.equal(family.loss_of(samples, fetched), family.loss(samples))


def test_data_workers_auto_leaves_a_core_per_process_on_gpus_and_none_on_the_cpu():
    def workers(*overrides, gpus=2, cpus=16):
        hw = Hardware(gpu_count=gpus, gpu_names=("H100",) * gpus, gpu_memory_gb=(80.0,) * gpus, bf16=True,
                      cpu_count=cpus)
        config = load_config(None, ["model.path=stand-in/model", *overrides], check_paths=False)
        plan = make_plan(config, hw)
        return plan.data_workers, plan.line().split(" · ")[-1]

    assert workers() == (4, "4 input workers per process")
    assert workers(cpus=6, gpus=2)[0] == 2
    assert workers(cpus=4, gpus=4)[0] == 0  # one core per process: the training process needs it
    assert workers("devices=cpu:2")[0] == 0
    assert workers("data.workers=3", "devices=cpu:1") == (3, "3 input workers per process")
    for bad in ("data.workers=-1", "data.workers=many"):
        with pytest.raises(ConfigError, match="data.workers"):
            load_config(None, ["model.path=stand-in/model", bad], check_paths=False)


def _rank(rank, *, data_s, forward_s, step_s=1.0):
    return {"rank": rank, "data_s": data_s, "forward_s": forward_s, "step_s": step_s}


def test_the_slowest_rank_is_named_only_past_the_margin():
    even = [_rank(r, data_s=0.01, forward_s=0.30) for r in range(4)]
    assert lagging_rank(even) is None
    assert lagging_rank(even[:3] + [_rank(3, data_s=0.09, forward_s=0.30)]) is None  # 8% of the step
    assert lagging_rank(even[:2] + [_rank(2, data_s=0.25, forward_s=0.30)] + even[3:]) == 2  # 24%
    assert lagging_rank([_rank(0, data_s=0.0, forward_s=0.9)]) is None  # nothing to lag behind


def test_summary_keeps_each_ranks_figures_and_leaves_out_what_does_not_apply():
    width = len(FIELDS)
    slots = [0.5, 0.01, 0.2, 0.05, 0.5, 900.0, 950.0, -1.0, -1.0] + [0.5, 0.3, 0.2, 0.0, 0.4, 800.0, 810.0, -1.0, -1.0]
    assert len(slots) == 2 * width
    summary = summarize(slots, 2)
    assert summary["data_s"] == 0.3 and summary["slowest_rank"] == 1
    assert summary["ranks"][0] == {"rank": 0, "step_s": 0.5, "data_s": 0.01, "forward_s": 0.2, "sync_s": 0.05,
                                   "cpu_s": 0.5, "rss_mb": 900.0, "peak_rss_mb": 950.0}
