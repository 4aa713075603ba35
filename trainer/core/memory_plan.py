"""The plan's memory part: reads the config and the machine, estimates the step's peak per GPU
(trainer.core.memory) and resolves `model.block_swap` (`auto`: the fewest swapped blocks that fit). Pure, torch-free.
"""

from __future__ import annotations

from trainer.core.config.schema import Config
from trainer.core.hardware import Hardware
from trainer.core.memory import RESERVE_GIB, MemoryPlan, estimate, fewest_swapped
from trainer.core.model_size import OPTIMIZER_STATE_BYTES
from trainer.core.registry import spec_of


def planned_gpu_gib(config: Config, hw: Hardware, device: str, gpu_ids: tuple[int, ...]) -> float | None:
    """The smallest GPU of the run; without a GPU here, the card the preset names (hardware.gpu_memory_gb)."""
    if device == "cuda" and hw.gpu_memory_gb:
        return min(hw.gpu_memory_gb[i] for i in gpu_ids if i < len(hw.gpu_memory_gb)) if gpu_ids else None
    return config.hardware.gpu_memory_gb or None


def text_cached(config: Config, family_default: bool) -> bool:
    """Whether the text encoders leave the GPU after the cache is built (as trainer.families.components.text_cache
    decides at run time)."""
    trains_text = config.lora.train_text_encoder if config.method == "lora" else config.full.train_text_encoder
    wanted = config.data.cache_text_embeddings
    return not trains_text and not config.data.shuffle_tags and (family_default if wanted is None else bool(wanted))


def plan_memory(config: Config, hw: Hardware, device: str, gpu_ids: tuple[int, ...], precision: str, sharding: str,
                world: int, notes: list[str], problems: list[str]) -> tuple[MemoryPlan | None, int]:
    """(the memory estimate or None, the blocks model.block_swap swaps). Adds a problem when `auto` finds nothing
    that fits, a note when an explicit setting is estimated not to fit."""
    swap = config.model.block_swap
    sizes = spec_of(config.model.family).sizes_for(config.model.path)
    gpu = planned_gpu_gib(config, hw, device, gpu_ids)
    if sizes is None or gpu is None:
        if swap == "auto":
            notes.append("model.block_swap: auto swaps no block: there is no GPU here to size it for (set "
                         "hardware.gpu_memory_gb to plan for one)")
        return None, swap if isinstance(swap, int) else 0
    per_device = config.batch.per_device if isinstance(config.batch.per_device, int) else 1
    # Planned for a card from the CPU: the precision that card would run (auto: bf16)
    if device != "cuda":
        precision = config.precision if config.precision != "auto" else "bf16"

    on_gpu = config.model.text_encoder_device != "cpu"

    def at(swapped: int, base_weights: str = config.model.base_weights,
           encoder_weights: str = config.model.text_encoder_weights) -> MemoryPlan:
        return estimate(sizes, gpu_gib=gpu, method=config.method, precision=precision, base_weights=base_weights,
                        swapped=swapped, checkpointing=config.train.gradient_checkpointing, rank=config.lora.rank,
                        optimizer_bytes=OPTIMIZER_STATE_BYTES.get(config.train.optimizer, 8),
                        resolution=config.data.resolution, per_device=per_device,
                        text_cached=text_cached(config, sizes.caches_text),
                        shards=world if sharding in ("fsdp", "deepspeed") else 1,
                        encode_alone=bool(sizes.blocks) and sharding == "ddp" and on_gpu,
                        encoder_weights=encoder_weights, encoders_on_gpu=on_gpu)

    if swap == "auto":
        chosen = fewest_swapped(lambda n: at(n).fits, sizes.block_count)
        if chosen is None:
            problems.append(_nothing_fits(config, at(sizes.block_count), at))
            return at(sizes.block_count), sizes.block_count
        return at(chosen), chosen
    assert isinstance(swap, int), "validate() accepts no text but auto"
    plan = at(min(swap, sizes.block_count))
    if not plan.fits:
        fix = ""
        # a full fine-tune is offered swapped blocks when it asked for DDP (auto shards one across GPUs with FSDP)
        if sizes.block_count and config.train.gradient_checkpointing and sharding == "ddp" and \
                (config.method == "lora" or config.distributed.sharding == "ddp"):
            fewest = fewest_swapped(lambda n: at(n).fits, sizes.block_count)
            fix = f" (model.block_swap: auto would swap {fewest})" if fewest is not None else ""
        notes.append(f"memory: the estimate, {plan.peak_gib:.1f} GB, is more than this {gpu:g} GB GPU less "
                     f"{RESERVE_GIB:g} GB for its context: expect out-of-memory{fix}")
    return plan, plan.swapped


def _nothing_fits(config: Config, plan: MemoryPlan, at) -> str:
    options = []
    if config.model.base_weights == "bf16" or config.model.base_weights == "fp8":
        for base in ("fp8", "nf4"):
            if base != config.model.base_weights:
                other = at(plan.blocks, base)
                options.append(f"model.base_weights={base} (~{other.peak_gib:.1f} GB{' fits' if other.fits else ''})")
    if plan.load_gib > plan.step_gib and config.model.text_encoder_weights != "nf4":
        other = at(plan.blocks, config.model.base_weights, "nf4")
        options.append(f"model.text_encoder_weights=nf4 (~{other.peak_gib:.1f} GB{' fits' if other.fits else ''})")
    if plan.load_gib > plan.step_gib:
        options.append("model.text_encoder_device=cpu (the encoders never on the GPU; slow, once)")
    where = ("while the text cache is built (the text encoders on the GPU)"
             if plan.load_gib > plan.step_gib else "in the step")
    parts = ", ".join(f"{what} {gib:.1f}" for what, gib in plan.parts)
    return (f"model.block_swap: auto finds nothing that fits this {plan.gpu_gib:g} GB GPU: with all {plan.blocks} "
            f"blocks swapped the estimate still peaks at {plan.peak_gib:.1f} GB {where} (step: {parts} GB; "
            f"{RESERVE_GIB:g} GB kept for the CUDA context). Lower data.resolution or batch.per_device"
            + (", or try " + " or ".join(options) if options else "") + ", or use a larger GPU.")

