"""Every key of the schema reaches the code that uses it: a key that validates but does nothing cannot come back.

One row per key (`ROWS`), and a key without a row fails `test_every_schema_key_has_a_row`. A row is either
- `Seen(change, observer)`: the observer runs the code that reads the key (the plan, the launcher's command, the
  data pipeline, the optimizer and its schedule, the loss, the adapter's peft config, the flow-matching draws,
  the sample shape) on the defaults and with `change`; what it returns must differ; or
- `Shown(test)`: the key's effect needs a training run or a model, and the named test asserts it (a real
  effect on weights, files or events); the row checks that the test exists.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trainer.core.config import load_config
from trainer.core.config.schema import iter_keys
from trainer.core.hardware import Hardware

TESTS = Path(__file__).parent
GPUS = Hardware(gpu_count=2, gpu_names=("H100", "H100"), gpu_memory_gb=(80.0, 80.0), bf16=True, xformers=True,
                cpu_count=16, gpu_capability=(9.0, 9.0))


@dataclass(frozen=True)
class Seen:
    change: str  # KEY=VALUE over the observer's base config
    observer: str  # a function of this module: (config, tmp_path) -> something comparable


@dataclass(frozen=True)
class Shown:
    test: str  # "test_file.py::test_name"


# ---- observers: each runs the code that reads its keys --------------------------------------------------------
def plan(config, tmp_path):
    from trainer.core.plan import make_plan

    return make_plan(config, GPUS).event()


def command(config, tmp_path):
    from trainer.core.launcher import build_command
    from trainer.core.plan import make_plan

    return build_command(tmp_path / "run", make_plan(config, GPUS), config)


def data(config, tmp_path):
    """The data pipeline (CaptionedLatents over a stand-in VAE) with generated class images drawn by a recorder."""
    from tests.test_caption_augment import _context
    from tests.test_captioned_latents import _VAE
    from trainer.families.components.captioned_latents import CaptionedLatents

    drawn = []

    def draw(prompts, seeds, *, steps, size):
        from PIL import Image

        drawn.append((tuple(prompts), steps, size))
        return [Image.new("RGB", (64, 64), (90, 90, 90)) for _ in prompts]

    pipeline = CaptionedLatents(_context(tmp_path, config)[0], _VAE(), draw_class_images=draw)
    count = pipeline.prepare()
    rows = [(p, 0, p % len(pipeline.images), p % len(pipeline.images), "instance") for p in range(24)]
    masks = pipeline.loss_masks(rows[:2], (8, 8))
    latents = [pipeline.latent_dist(i, e, e, "instance")[0].sum().item() for i in range(len(pipeline.images))
               for e in range(4)]
    loss = pipeline.loss([(7, 0, 0)], lambda rs, stream: torch.tensor([{"instance": 1.0, "class": 3.0}[r[-1]]
                                                                       for r in rs])).item()
    return (count, [pipeline.target(i, "instance") for i in range(len(pipeline.images))], len(pipeline.held_out),
            [pipeline.row_caption(r) for r in rows], pipeline.use_cache, None if masks is None else masks.sum().item(),
            pipeline.center_cropped("instance"), latents, drawn, len(pipeline.class_images), loss,
            [i.caption for i in pipeline.images])


def optimizer(config, tmp_path):
    from trainer.engine.optim import build_optimizer, build_scheduler

    weight = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([{"params": [weight], "lr": config.train.lr}], config.train)
    schedule = build_scheduler(opt, config.train)
    lrs = []
    for _ in range(config.train.steps if config.train.steps <= 50 else 50):
        weight.grad = torch.ones(4)
        opt.step()
        schedule.step()
        lrs.append(round(schedule.get_last_lr()[0], 12))
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params" and isinstance(v, (int, float, tuple))}
    return type(opt).__name__, hyper, lrs, weight.detach().tolist()


def loss(config, tmp_path):
    from diffusers import DDPMScheduler

    from trainer.families.components import noise
    from trainer.families.components.objective import Objective

    generator = torch.Generator().manual_seed(0)
    draws = noise.draw(generator, (4, 8, 8), num_timesteps=1000, noise_offset=config.train.noise_offset)
    scheduler = DDPMScheduler(**noise.zero_terminal_snr({}, enabled=config.model.zero_terminal_snr,
                                                        prediction_type="v_prediction"))
    objective = Objective.from_config(config.train)
    pred, target = torch.zeros(2, 4, 8, 8), torch.linspace(-1, 1, 512).reshape(2, 4, 8, 8)
    per_sample = noise.per_sample_loss(pred, target, scheduler=scheduler, timesteps=torch.tensor([10, 900]),
                                       prediction_type="epsilon", min_snr_gamma=config.train.min_snr_gamma,
                                       objective=objective)
    perturbed = objective.input_noise(torch.Generator().manual_seed(1), draws.noise)
    return (draws.noise.sum().item(), per_sample.tolist(), perturbed.sum().item(),
            float(scheduler.alphas_cumprod[-1]))


def flow(config, tmp_path):
    from trainer.families.components import flow_matching as fm

    f = config.flow
    sigmas = [fm.draw_sample(torch.Generator().manual_seed(s), (4, 8, 8), scheme=f.timestep_sampling,
                             logit_mean=f.logit_mean, logit_std=f.logit_std, shift=f.shift)[1] for s in range(8)]
    return sigmas, fm.loss_weight(torch.tensor([0.2, 0.7]), f.weighting).tolist()


def peft(config, tmp_path):
    from trainer.families.components.adapters import peft_config

    made = peft_config(config.lora, config.lora.unet_targets)
    return {k: v for k, v in vars(made).items() if isinstance(v, (int, float, str, bool, list, set, type(None)))}


def sample_shape(config, tmp_path):
    from trainer.families.components.trained_weights import sample_prompts, sample_shape

    return sample_shape(config.sample, config.data.resolution), sample_prompts(config.sample)


# ---- the table ------------------------------------------------------------------------------------------------
ROWS: dict[str, Seen | Shown] = {
    "version": Shown("test_config.py::test_migrations_run_in_order_and_newer_versions_are_refused"),
    "name": Shown("test_launcher.py::test_run_name_is_never_overwritten"),
    "method": Shown("test_sdxl.py::test_full_fine_tune_writes_a_diffusers_folder_and_fp16_keeps_the_vae_fp32"),
    "seed": Seen("seed=3", "data"),
    "devices": Seen("devices=1", "plan"),
    "precision": Seen("precision=fp16", "plan"),
    "attention": Seen("attention=sdpa", "plan"),
    "model.family": Shown("test_demo_presets.py::test_the_demo_preset_trains_to_done_and_its_lora_loads"),
    "model.path": Shown("test_sd_loading.py::test_single_file_checkpoint_loads_like_its_diffusers_folder"),
    "model.config": Shown("test_sd_loading.py::test_single_file_checkpoint_loads_like_its_diffusers_folder"),
    "model.prediction_type": Shown("test_sd_loading.py::test_prediction_type_override_and_auto"),
    "model.revision": Shown("test_keys_reach_code.py::test_hub_keys_reach_from_pretrained"),
    "model.variant": Shown("test_keys_reach_code.py::test_hub_keys_reach_from_pretrained"),
    "model.base_weights": Shown("test_base_weights.py::test_fp8_base_weights_store_the_network_in_float8_and_the_lora_still_learns"),
    "model.fp8_compute": Seen("model.fp8_compute=auto", "plan"),
    "model.text_encoder_device": Shown("test_text_encoder_weights.py::test_encoding_on_the_cpu_takes_the_encoders_out_of_the_gpu_plan_and_needs_the_text_cache"),
    "model.text_encoder_weights": Shown("test_text_encoder_weights.py::test_quantized_text_encoders_give_nearly_the_same_embeddings_and_the_lora_trains_on_them"),
    "hardware.gpu_memory_gb": Shown("test_memory_plan.py::test_auto_swaps_the_fewest_blocks_that_fit_the_card_the_preset_names"),
    "hardware.gpus": Shown("test_memory_plan.py::test_a_dry_run_plans_a_sharded_full_fine_tune_for_the_gpus_the_preset_names"),
    "model.block_swap": Shown("test_block_swap.py::test_swapped_blocks_train_exactly_as_resident_ones_and_are_copied_for_forward_and_recompute"),
    "model.zero_terminal_snr": Seen("model.zero_terminal_snr=true", "loss"),
    "data.path": Shown("test_data.py::test_captions_from_same_name_text_files"),
    "data.datasets": Shown("test_datasets.py::test_each_folder_trains_with_its_own_repeats_resolution_flip_and_captions"),
    "data.instance_prompt": Seen("data.instance_prompt=a photo of sks", "data"),
    "data.caption_extension": Seen("data.caption_extension=.caption", "data"),
    "data.resolution": Seen("data.resolution=16", "data"),
    "data.center_crop": Seen("data.center_crop=false", "data"),
    "data.flip": Seen("data.flip=true", "data"),
    "data.cache_latents": Seen("data.cache_latents=false", "data"),
    "data.workers": Shown("test_input_pipeline.py::test_workers_make_the_same_detection_micro_batches_and_losses"),
    "data.bucketing": Seen("data.bucketing=true", "data"),
    "data.bucket_step": Seen("data.bucket_step=8", "data"),
    "data.bucket_max_aspect": Seen("data.bucket_max_aspect=1.0", "data"),
    "data.bucket_min_side": Seen("data.bucket_min_side=32", "data"),
    "data.bucket_max_side": Seen("data.bucket_max_side=32", "data"),
    "data.val_split": Seen("data.val_split=0.25", "data"),
    "data.val_path": Shown("test_val_loss.py::test_the_plan_counts_the_held_out_images_and_val_path_is_a_confined_path"),
    "data.cache_text_embeddings": Shown("test_flow_text_cache.py::test_a_prompt_outside_the_cache_brings_the_encoders_back_for_that_sample"),
    "data.caption_prefix": Seen("data.caption_prefix=sks", "data"),
    "data.caption_dropout": Seen("data.caption_dropout=0.5", "data"),
    "data.shuffle_tags": Seen("data.shuffle_tags=true", "data"),
    "data.keep_tokens": Shown("test_caption_augment.py::test_dropout_drops_the_stated_fraction_and_shuffling_keeps_the_leading_tags"),
    "data.masks": Seen("data.masks=alpha", "data"),
    "data.control_path": Shown("test_paired_data.py::test_each_control_gets_its_targets_random_crop_and_flip"),
    "lora.rank": Seen("lora.rank=4", "peft"),
    "lora.alpha": Seen("lora.alpha=4", "peft"),
    "lora.dropout": Seen("lora.dropout=0.1", "peft"),
    "lora.unet_targets": Seen("lora.unet_targets=[to_q]", "peft"),
    "lora.train_text_encoder": Shown("test_caption_augment.py::test_sd_trains_on_the_drawn_captions_and_keeps_no_token_ids_of_shuffled_ones"),
    "lora.text_encoder_targets": Shown("test_keys_reach_code.py::test_text_encoder_targets_and_rate_reach_the_text_encoder"),
    "lora.type": Seen("lora.type=lokr", "peft"),
    "lora.factor": Shown("test_adapters.py::test_sd_adapters_train_and_their_files_reload_to_the_trained_weights"),
    "lora.dora": Seen("lora.dora=true", "peft"),
    "lora.init_from": Shown("test_adapters.py::test_init_from_starts_at_the_files_update_whatever_its_format_and_alpha"),
    "lora.ema": Shown("test_lora_ema.py::test_samples_see_the_average_and_training_gets_its_weights_back_bit_for_bit"),
    "lora.ema_decay": Shown("test_lora_ema.py::test_the_average_follows_the_decay_its_help_states"),
    "full.train_text_encoder": Shown("test_fsdp.py::test_sd_full_finetune_with_its_text_encoder_under_fsdp_matches_one_process"),
    "full.ema": Shown("test_lora_ema.py::test_which_runs_keep_an_average"),
    "full.ema_decay": Shown("test_lora_ema.py::test_which_runs_keep_an_average"),
    "full.save_single_file": Shown("test_export_sdxl.py::test_a_full_fine_tune_writes_the_single_file_by_default"),
    "prior.enabled": Seen("prior.enabled=true", "data"),
    "prior.class_path": Shown("test_captioned_latents.py::test_class_images_come_from_the_callback_and_the_prior_loss_is_weighted"),
    "prior.class_prompt": Seen("prior.class_prompt=a dog", "data"),
    "prior.num_class_images": Seen("prior.num_class_images=3", "data"),
    "prior.loss_weight": Seen("prior.loss_weight=0.25", "data"),
    "prior.sample_steps": Seen("prior.sample_steps=7", "data"),
    "flow.timestep_sampling": Seen("flow.timestep_sampling=uniform", "flow"),
    "flow.logit_mean": Seen("flow.logit_mean=0.5", "flow"),
    "flow.logit_std": Seen("flow.logit_std=2.0", "flow"),
    "flow.shift": Seen("flow.shift=3.0", "flow"),
    "flow.weighting": Seen("flow.weighting=cosmap", "flow"),
    "flow.guidance": Shown("test_keys_reach_code.py::test_flux_guidance_sequence_length_and_targets_reach_the_transformer"),
    "flow.max_sequence_length": Shown("test_keys_reach_code.py::test_flux_guidance_sequence_length_and_targets_reach_the_transformer"),
    "flow.lora_targets": Shown("test_keys_reach_code.py::test_flux_guidance_sequence_length_and_targets_reach_the_transformer"),
    "flow.training_adapter": Shown("test_zimage.py::test_a_run_with_a_training_adapter_trains_and_saves_only_its_lora"),
    "flow.lora_blocks": Shown("test_keys_reach_code.py::test_flux_guidance_sequence_length_and_targets_reach_the_transformer"),
    "batch.total": Seen("batch.total=8", "plan"),
    "batch.per_device": Seen("batch.per_device=2", "plan"),
    "train.steps": Seen("train.steps=20", "plan"),
    "train.lr": Seen("train.lr=0.5", "optimizer"),
    "train.text_encoder_lr": Shown("test_keys_reach_code.py::test_text_encoder_targets_and_rate_reach_the_text_encoder"),
    "train.optimizer": Seen("train.optimizer=sgd", "optimizer"),
    "train.weight_decay": Seen("train.weight_decay=0.5", "optimizer"),
    "train.betas": Seen("train.betas=[0.5,0.9]", "optimizer"),
    "train.eps": Seen("train.eps=0.1", "optimizer"),
    "train.scheduler": Seen("train.scheduler=linear", "optimizer"),
    "train.scheduler_cycles": Seen("train.scheduler_cycles=3", "optimizer"),
    "train.scheduler_power": Seen("train.scheduler_power=3.0", "optimizer"),
    "train.warmup_steps": Seen("train.warmup_steps=5", "optimizer"),
    "train.max_grad_norm": Shown("test_keys_reach_code.py::test_max_grad_norm_caps_the_first_update"),
    "train.noise_offset": Seen("train.noise_offset=0.1", "loss"),
    "train.min_snr_gamma": Seen("train.min_snr_gamma=5", "loss"),
    "train.loss": Seen("train.loss=l1", "loss"),
    "train.huber_delta": Shown("test_objective.py::test_the_loss_choice_reaches_every_family"),
    "train.input_perturbation": Seen("train.input_perturbation=0.1", "loss"),
    "train.compile": Shown("test_compile.py::test_compiled_training_matches_eager_and_samples_still_draw"),
    "train.gradient_checkpointing": Shown("test_base_weights.py::test_fp8_base_weights_store_the_network_in_float8_and_the_lora_still_learns"),
    "train.channels_last": Seen("train.channels_last=off", "plan"),
    "train.max_nonfinite_steps": Shown("test_engine.py::test_non_finite_losses_fail_the_run_and_keep_the_last_good_checkpoint"),
    "sample.every": Shown("test_tiny_base.py::test_the_demo_lora_teaches_the_concept_and_keeps_the_control"),
    "sample.prompts": Seen("sample.prompts=[a cat]", "sample_shape"),
    "sample.images_per_prompt": Shown("test_shape_score.py::test_every_sample_prompt_gets_its_images_from_fixed_seeds_and_scored_prompts_are_drawn_once"),
    "sample.concept.prompt": Seen("sample.concept={prompt: sks circle, shows: yellow circle}", "sample_shape"),
    "sample.concept.shows": Shown("test_shape_score.py::test_every_sample_prompt_gets_its_images_from_fixed_seeds_and_scored_prompts_are_drawn_once"),
    "sample.control.prompt": Seen("sample.control={prompt: a red square, shows: red square}", "sample_shape"),
    "sample.control.shows": Shown("test_shape_score.py::test_every_sample_prompt_gets_its_images_from_fixed_seeds_and_scored_prompts_are_drawn_once"),
    "sample.negative_prompt": Shown("test_flow_text_cache.py::test_a_prompt_outside_the_cache_brings_the_encoders_back_for_that_sample"),
    "sample.seed": Shown("test_shape_score.py::test_every_sample_prompt_gets_its_images_from_fixed_seeds_and_scored_prompts_are_drawn_once"),
    "sample.steps": Shown("test_tiny_base.py::test_the_base_draws_the_shape_and_colour_a_prompt_asks_for"),
    "sample.guidance_scale": Shown("test_tiny_base.py::test_the_base_draws_the_shape_and_colour_a_prompt_asks_for"),
    "sample.size": Seen("sample.size=16", "sample_shape"),
    "sample.width": Seen("sample.width=48", "sample_shape"),
    "sample.height": Seen("sample.height=48", "sample_shape"),
    "eval.every": Shown("test_val_loss.py::test_the_best_checkpoint_keeps_the_lowest_val_loss"),
    "eval.best": Shown("test_val_loss.py::test_the_best_checkpoint_keeps_the_lowest_val_loss"),
    "detection.weights": Shown("test_detection.py::test_pretrained_weights_file_freezes_batchnorm_and_replaces_the_head"),
    "detection.trainable_backbone_layers": Shown("test_detection_detr.py::test_weights_load_through_from_pretrained_with_a_new_head"),
    "detection.backbone_lr_scale": Shown("test_keys_reach_code.py::test_backbone_lr_scale_is_the_backbones_group_rate"),
    "detection.sync_batchnorm": Shown("test_detection_data.py::test_detection_config_checks"),
    "detection.images": Shown("test_detection_data.py::test_coco_validation_file_and_images_folder"),
    "detection.val_path": Shown("test_detection_data.py::test_validation_split_is_seeded_and_disjoint"),
    "detection.val_fraction": Shown("test_detection_data.py::test_validation_split_is_seeded_and_disjoint"),
    "detection.augment": Shown("test_detection_data.py::test_augmentations_keep_boxes_on_their_objects"),
    "detection.score_threshold": Shown("test_detection.py::test_each_architecture_trains_evaluates_draws_saves_and_reloads"),
    "detection.max_detections": Shown("test_detection.py::test_each_architecture_trains_evaluates_draws_saves_and_reloads"),
    "detection.eval_images": Shown("test_detection.py::test_each_architecture_trains_evaluates_draws_saves_and_reloads"),
    "detection.sample_images": Shown("test_detection.py::test_each_architecture_trains_evaluates_draws_saves_and_reloads"),
    "detection.best_metric": Shown("test_val_loss.py::test_the_best_checkpoint_keeps_the_lowest_val_loss"),
    "checkpoint.every": Shown("test_engine.py::test_stopped_then_resumed_on_another_process_count_matches"),
    "checkpoint.keep": Shown("test_checkpoint.py::test_checkpoints_are_complete_and_only_the_last_k_are_kept"),
    "checkpoint.export": Shown("test_export_checkpoint.py::test_checkpoint_export_writes_the_outputs_of_every_checkpoint"),
    "distributed.nodes": Seen("distributed.nodes=3", "command"),
    "distributed.node_rank": Seen("distributed.node_rank=1", "command"),
    "distributed.master_addr": Seen("distributed.master_addr=127.0.0.2", "command"),
    "distributed.master_port": Seen("distributed.master_port=29600", "command"),
    "distributed.timeout_s": Seen("distributed.timeout_s=60", "command"),
    "distributed.stall_warning_s": Shown("test_stall.py::test_a_frozen_rank_is_warned_about_then_the_run_fails_naming_it"),
    "distributed.stall_timeout_s": Shown("test_stall.py::test_a_frozen_rank_is_warned_about_then_the_run_fails_naming_it"),
    "distributed.sharding": Seen("distributed.sharding=fsdp", "plan"),
    "distributed.zero_stage": Seen("distributed.zero_stage=1", "plan"),
    "logging.tensorboard": Shown("test_mirrors.py::test_a_stopped_and_resumed_run_logs_one_tensorboard_run_and_one_wandb_run"),
    "logging.wandb": Shown("test_mirrors.py::test_a_stopped_and_resumed_run_logs_one_tensorboard_run_and_one_wandb_run"),
    "output.push_to_hub": Shown("test_hub.py::test_a_done_run_uploads_its_outputs_samples_and_card_with_the_token_from_the_environment"),
}

# What each observer's base config adds to the defaults (the keys it compares need a context to show).
BASE = {
    "plan": ["devices=2", "batch.total=4", "method=lora"],
    "command": ["devices=2", "distributed.nodes=2", "batch.total=12"],
    "data": ["data.resolution=32", "data.bucket_step=16", "precision=fp32", "devices=cpu:1", "batch.total=2", "prior.class_prompt=a shape",
             "prior.num_class_images=2"],
    "optimizer": ["train.steps=12", "train.scheduler=cosine_with_restarts", "train.warmup_steps=2"],
    "loss": [], "peft": [], "sample_shape": ["data.resolution=32"],
    "flow": ["flow.shift=1.0"],  # unset: the model's own scheduler decides (not read here)
}
# A change needs a companion setting to be allowed or to show (e.g. prior keys need prior.enabled).
NEEDS = {
    "prior.class_prompt": ["prior.enabled=true"], "prior.num_class_images": ["prior.enabled=true"],
    "prior.loss_weight": ["prior.enabled=true"], "prior.sample_steps": ["prior.enabled=true"],
    "data.bucket_step": ["data.bucketing=true"], "data.bucket_max_aspect": ["data.bucketing=true"],
    "data.bucket_min_side": ["data.bucketing=true"], "data.bucket_max_side": ["data.bucketing=true"],
    "distributed.sharding": ["method=full"], "distributed.zero_stage": ["method=full", "distributed.sharding=deepspeed",
                                                                        "precision=bf16"],
    "train.scheduler_power": ["train.scheduler=polynomial"], "seed": ["data.flip=true"],
    "train.scheduler": ["train.warmup_steps=0"],
    "model.fp8_compute": ["model.base_weights=fp8", "train.gradient_checkpointing=true"],
}


def test_every_schema_key_has_a_row():
    keys = [name for name, _ in iter_keys()]
    assert sorted(set(keys) - set(ROWS)) == [], "a new key needs a row: how its effect is seen"
    assert sorted(set(ROWS) - set(keys)) == [], "a row for a key the schema no longer has"


def _defined_tests() -> set[str]:
    names = set()
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names |= {f"{path.name}::{node.name}" for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    return names


def test_every_key_shown_by_a_test_names_one_that_exists():
    defined = _defined_tests()
    missing = sorted(f"{key}: {row.test}" for key, row in ROWS.items()
                     if isinstance(row, Shown) and row.test not in defined)
    assert missing == []


def _images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for n, (w, h) in enumerate([(64, 64), (96, 48), (48, 96), (64, 64)]):
        image = Image.new("RGBA", (w, h), (200, 40 + 30 * n, 40, 255))
        image.paste((255, 255, 255, 0), (0, 0, w // 3, h))  # a transparent band on the left: flips and masks show
        image.save(folder / f"img{n}.png")
        (folder / f"img{n}.txt").write_text(f"tag{n}, red, shape")
        (folder / f"img{n}.caption").write_text(f"other caption {n}")
    (folder / "plain.png").write_bytes((folder / "img0.png").read_bytes())  # no caption file: instance_prompt's
    return folder


@pytest.mark.parametrize("key", [k for k, row in ROWS.items() if isinstance(row, Seen)])
def test_a_key_changes_what_the_code_that_reads_it_does(key, tmp_path):
    row = ROWS[key]
    observe: Callable = globals()[row.observer]
    folder = _images(tmp_path / "data")
    common = ["model.path=stand-in/model", f"data.path={folder}", f"prior.class_path={tmp_path / 'class'}",
              "data.instance_prompt=a photo", *BASE[row.observer], *NEEDS.get(key, [])]
    base = load_config(None, common, check_paths=False)
    changed = load_config(None, [*common, row.change], check_paths=False)
    assert getattr_path(changed, key) != getattr_path(base, key), f"{row.change} does not change {key}"
    before = observe(base, tmp_path / "before")
    after = observe(changed, tmp_path / "after")
    assert before != after, f"{key}: {row.change} changed nothing {row.observer} does"


def getattr_path(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


# ---- keys whose code needs a model: small tests of their own ---------------------------------------------------
def test_hub_keys_reach_from_pretrained():
    from trainer.families.components.sd_loading import load_pipeline

    calls = []

    class Pipeline:
        @classmethod
        def from_pretrained(cls, path, **kwargs):
            calls.append((path, kwargs))
            return "pipeline"

    config = load_config(None, ["model.path=org/some-model", "model.revision=abc123", "model.variant=fp16"],
                         check_paths=False)
    assert load_pipeline(config.model, Pipeline) == "pipeline"
    assert calls[0][0] == "org/some-model"
    assert (calls[0][1]["revision"], calls[0][1]["variant"]) == ("abc123", "fp16")


@pytest.mark.slow
def test_text_encoder_targets_and_rate_reach_the_text_encoder(tmp_path, tiny_sd_path):
    """lora.text_encoder_targets chooses the text encoder's adapted layers; train.text_encoder_lr is the learning
    rate of the text encoder's parameter group (the UNet's stays train.lr)."""
    from tests.test_caption_augment import _family

    def family(*overrides):
        built, _ = _family(tmp_path / "-".join(overrides).replace("/", "_"), "sd", tiny_sd_path,
                           "lora.train_text_encoder=true", *overrides)
        return built

    def adapted(built):
        return sorted({name.split(".lora_A")[0].rsplit(".", 1)[-1]
                       for name, _ in built.text_encoder.named_parameters() if ".lora_A" in name})

    default = family()
    assert adapted(default) == ["k_proj", "out_proj", "q_proj", "v_proj"]
    assert [g["lr"] for g in default.param_groups()] == [1e-4, 1e-4]
    chosen = family("lora.text_encoder_targets=[q_proj]", "train.text_encoder_lr=5e-6")
    assert adapted(chosen) == ["q_proj"]
    assert [g["lr"] for g in chosen.param_groups()] == [1e-4, 5e-6]


def test_flux_guidance_sequence_length_and_targets_reach_the_transformer():
    from tests.test_flow_matching import _flux_family

    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return (kwargs["hidden_states"],)

    def run(*overrides):
        family = _flux_family(True, *overrides)
        text = {"embeds": torch.zeros(1, 3, 16), "pooled": torch.zeros(1, 16)}
        family.forward(model, torch.zeros(1, 16, 4, 4), torch.tensor([0.5]), text)
        return float(seen["guidance"][0]), family.max_sequence_length(), family.flow.lora_target_paths()

    guidance, length, targets = run()
    assert (guidance, length) == (1.0, 512)  # flow.guidance's default; FLUX.1-dev's T5 length
    changed = run("flow.guidance=3.5", "flow.max_sequence_length=128", "flow.lora_blocks=single")
    assert changed[:2] == (3.5, 128)
    assert changed[2] != targets and all(p.startswith("single_transformer_blocks.") for p in changed[2])


def test_backbone_lr_scale_is_the_backbones_group_rate(tmp_path):
    from tests.test_detection import make_family
    from trainer.families.detection.demo import make_shapes_coco

    shapes = make_shapes_coco(tmp_path / "shapes", train=4, val=2, size=64)
    arch = "fasterrcnn_mobilenet_v3_large_fpn"
    whole = make_family(shapes, arch, tmp_path / "a", "detection.trainable_backbone_layers=6")
    assert [g["lr"] for g in whole.param_groups()] == [1e-4]
    scaled = make_family(shapes, arch, tmp_path / "b", "detection.trainable_backbone_layers=6",
                         "detection.backbone_lr_scale=0.1")
    groups = scaled.param_groups()
    assert [g["lr"] for g in groups] == pytest.approx([1e-4, 1e-5])
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(
        p.numel() for g in whole.param_groups() for p in g["params"])


@pytest.mark.slow
def test_max_grad_norm_caps_the_first_update(tmp_path, tiny_sd_path, demo_data_path):
    """With SGD the first update is lr x the (clipped) gradient: LoRA's up weights start at zero, so after one
    step their norm is at most lr x train.max_grad_norm, and far more without clipping."""
    from tests.engine_helpers import engine_config, final_weights, launch

    def up_norm(max_grad_norm):
        config = engine_config(tiny_sd_path, demo_data_path, "devices=cpu:1", "train.steps=1", "train.warmup_steps=0",
                               "train.optimizer=sgd", "train.lr=0.1", "train.scheduler=constant",
                               f"train.max_grad_norm={max_grad_norm}", f"name=clip{max_grad_norm}")
        run_dir, final = launch(tmp_path / "runs", config)
        assert final["type"] == "done", final
        ups = [w for name, w in final_weights(run_dir).items() if "lora_B" in name]
        return torch.sqrt(sum((w.float() ** 2).sum() for w in ups)).item()

    clipped, free = up_norm(1e-4), up_norm(0)
    assert clipped <= 0.1 * 1e-4 * 1.001 < free / 10
