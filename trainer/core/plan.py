"""The plan: how a config runs on this machine. A pure function of (Config, Hardware), torch-free.

`batch.total` is the effective batch of one optimizer step on any number of devices;
accumulation = total / (per_device x world_size). Steps, schedules and epochs count optimizer steps, so the
same preset trains the same way on 1, 2 or 8 processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainer.core.compute_paths import channels_last, fp8_compute
from trainer.core.compiling import compile_note, sharding_problem, toolchain_problem
from trainer.core.config.schema import Config
from trainer.core.config.validate import parse_devices
from trainer.errors import ConfigError
from trainer.core.registry import spec_of
from trainer.core.hardware import Hardware
from trainer.core.memory_plan import plan_memory


@dataclass(frozen=True)
class Plan:
    device: str  # "cuda" or "cpu"
    gpu_ids: tuple[int, ...]  # CUDA_VISIBLE_DEVICES for the workers; empty on CPU
    nodes: int
    processes_per_node: int
    per_device: int
    accumulation: int
    total: int
    precision: str  # "bf16" | "fp16" | "fp32"
    attention: str  # "sdpa" | "xformers"
    steps: int
    notes: tuple[str, ...] = field(default=())
    sharding: str = "ddp"  # "ddp" | "fsdp" (trainer.engine.parallel.fsdp) | "deepspeed" (trainer.engine.parallel.deepspeed)
    zero_stage: int = 0  # DeepSpeed's ZeRO stage (1 or 2) when sharding is "deepspeed"
    # Aspect-ratio buckets ((width, height, images), the fullest first) when data.bucketing is on; filled in by
    # the launcher from the dataset scan (`with_buckets`), since the plan itself reads no files.
    buckets: tuple[tuple[int, int, int], ...] = field(default=())
    # Images held out of training for the validation loss (data.val_split / data.val_path), from the same scan.
    val_images: int = 0
    # batch.per_device auto on GPUs: the workers probe the largest micro-batch that fits (trainer.engine.batch_probe).
    probe_batch: bool = False
    # Input processes per training process (data.workers; trainer.engine.input): 0 loads on the training thread.
    data_workers: int = 0
    # model.fp8_compute: the frozen Linear layers multiply in fp8 (trainer.families.components.fp8_linear).
    fp8_compute: bool = False
    # train.channels_last: the UNet and VAE are stored channels-last (trainer.families.components.unet_training).
    channels_last: bool = False
    # model.block_swap resolved: how many of the transformer's last blocks keep their frozen weights in CPU memory
    # (trainer.families.components.block_swap).
    block_swap: int = 0
    # The memory part's line (trainer.core.memory): the step's estimated peak per GPU; empty without an estimate.
    memory: str = ""
    # The text and latent caches' disk figures (trainer.core.cache_plan), from the launcher's dataset scan.
    caches: str = ""
    # Where the multi-node settings came from when a scheduler gave them (trainer.core.slurm), for the plan line.
    cluster: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    def line(self) -> str:
        """One line a person reads before anything starts."""
        procs = self.world_size
        nodes = f"{self.nodes} nodes x " if self.nodes > 1 else ""
        per_node = f"{self.processes_per_node} process{'es' if self.processes_per_node > 1 else ''}"
        head = f"{nodes}{per_node}" if self.nodes > 1 else f"{procs} process{'es' if procs > 1 else ''}"
        where = "cpu" if self.device == "cpu" else f"gpu {','.join(map(str, self.gpu_ids))}"
        line = (
            f"{head} x {self.per_device} per device x accumulation {self.accumulation} = batch {self.total}"
            f" · {self.precision}{' · fp8 matmul' if self.fp8_compute else ''} · {self.attention}"
            f"{self._sharding_text()} · {where}"
        )
        if self.block_swap:
            line += f" · {self.block_swap} block{'s' if self.block_swap > 1 else ''} swapped"
        if self.buckets:
            from trainer.core.data.buckets import describe

            line += f" · buckets {describe(self.buckets)}"
        if self.data_workers:
            line += f" · {self.data_workers} input worker{'s' if self.data_workers > 1 else ''} per process"
        if self.val_images:
            line += f" · val_loss on {self.val_images} held-out image{'s' if self.val_images != 1 else ''}"
        if self.cluster:
            line += f" · {self.cluster}"
        return line

    def _sharding_text(self) -> str:
        if self.sharding == "fsdp":
            return " · fsdp"
        if self.sharding == "deepspeed":
            return f" · deepspeed zero-{self.zero_stage}"
        return ""

    def event(self) -> dict:
        """The fields of the run's first event (`plan`)."""
        data = asdict(self)
        data.update(
            world_size=self.world_size,
            devices="cpu" if self.device == "cpu" else list(self.gpu_ids),
            line=self.line(),
            notes=list(self.notes),
            buckets=[{"width": w, "height": h, "images": n} for w, h, n in self.buckets],
        )
        return data

    @classmethod
    def from_event(cls, event: dict) -> "Plan":
        names = cls.__dataclass_fields__.keys()
        data = {k: event[k] for k in names if k in event}
        data["gpu_ids"] = tuple(data.get("gpu_ids", ()))
        data["notes"] = tuple(data.get("notes", ()))
        data["buckets"] = tuple((b["width"], b["height"], b["images"]) for b in data.get("buckets", ()))
        return cls(**data)

    def with_buckets(self, config: Config, scan) -> "Plan":
        """This plan listing the shapes the images of `scan` (trainer.core.data.scan) train at when there can be
        several (data.bucketing, data.datasets), with a note naming the shapes that hold fewer images than one
        step's batch."""
        data = config.data
        if not ((data.bucketing or data.datasets) and spec_of(config.model.family).bucket_multiple
                and getattr(scan, "items", None)):
            return self
        from collections import Counter
        from dataclasses import replace

        from trainer.core.data.sources import image_targets

        targets = image_targets(scan.items, data, True)
        images, expanded = Counter(targets), Counter[tuple[int, int]]()
        for item, target in zip(scan.items, targets):
            expanded[target] += item.repeats

        def fullest_first(counts):
            return [(w, h, n) for (w, h), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][0] / kv[0][1]))]

        small = [f"{w}x{h} ({n})" for w, h, n in fullest_first(expanded) if n < self.total]
        buckets = tuple(fullest_first(images))
        compiled = compile_note(config, self.per_device, buckets)  # train.compile: now with the shapes it compiles for
        notes = tuple(compiled if compiled and note.startswith("train.compile:") else note for note in self.notes)
        if small:
            notes += (f"buckets with fewer images than batch {self.total} repeat some of them within a step: "
                      f"{', '.join(small)}",)
        return replace(self, buckets=buckets, notes=notes)

    def with_caches(self, config: Config, scan) -> "Plan":
        """This plan with what the text and latent caches will write for the dataset of `scan`."""
        from dataclasses import replace

        from trainer.core.cache_plan import cache_line
        from trainer.core.memory_plan import text_cached

        sizes = spec_of(config.model.family).sizes_for(config.model.path)
        if sizes is None:
            return self
        # Planned for a card from the CPU: the precision that card would run (as the memory plan does)
        precision = self.precision
        if self.device != "cuda" and config.hardware.gpu_memory_gb:
            precision = config.precision if config.precision != "auto" else "bf16"
        return replace(self, caches=cache_line(config, sizes, scan, precision, text_cached(config, sizes.caches_text)))

    def with_held_out(self, scan) -> "Plan":
        """This plan counting the images `scan` (trainer.core.data.holdout.training_scan) keeps out of training."""
        from dataclasses import replace

        return replace(self, val_images=len(getattr(scan, "held_out", None) or ()))


def resolve_batch(total: int, per_device: int, world_size: int) -> tuple[int, int, int, list[str]]:
    """(total, per_device, accumulation, notes) such that total = per_device x world_size x accumulation.

    Keeps the requested total whenever it divides by the number of processes (lowering per_device to a
    divisor if needed); otherwise rounds the total to the nearest multiple and says so.
    """
    notes: list[str] = []
    if total % world_size:
        rounded = max(world_size, round(total / world_size) * world_size)
        notes.append(
            f"batch.total {total} is not a multiple of {world_size} processes; using batch {rounded} "
            f"(set batch.total to a multiple of {world_size} to choose yourself)"
        )
        total = rounded
    per_rank = total // world_size
    wanted = per_device
    per_device = min(per_device, per_rank)
    while per_rank % per_device:
        per_device -= 1
    if per_device != wanted:
        notes.append(
            f"batch.per_device lowered from {wanted} to {per_device} so that {per_device} per device x "
            f"{world_size} process{'es' if world_size > 1 else ''} x accumulation {per_rank // per_device} "
            f"= batch {total} exactly"
        )
    return total, per_device, per_rank // per_device, notes


def choose_sharding(config: Config, hw: Hardware, device: str, world: int,
                    parameters: int | None) -> tuple[str, list[str]]:
    """("ddp" | "fsdp", notes). `parameters`: the trained network's size (trainer.core.model_size), if known."""
    from trainer.core.model_size import full_finetune_bytes

    wanted = config.distributed.sharding
    if wanted != "auto":
        return wanted, []
    if config.method != "full" or device != "cuda" or not parameters or not hw.gpu_memory_gb:
        return "ddp", []
    if config.model.block_swap != 0:  # each GPU holds swapped blocks in CPU memory: the memory plan sizes that
        return "ddp", []
    need_gb = full_finetune_bytes(parameters, config.train.optimizer) / 2**30
    have_gb = min(hw.gpu_memory_gb)
    if need_gb <= 0.8 * have_gb:
        return "ddp", []
    if world == 1:
        return "ddp", [f"a full fine-tune of {parameters / 1e9:.1f} B parameters needs about {need_gb:.0f} GB for "
                       f"weights, gradients and {config.train.optimizer} state, more than this GPU's {have_gb:.0f} "
                       "GB: expect out-of-memory; use more GPUs (sharded with FSDP), train.optimizer=adamw8bit, "
                       "or method=lora"]
    return "fsdp", [f"sharding: fsdp, because a full fine-tune of {parameters / 1e9:.1f} B parameters needs about "
                    f"{need_gb:.0f} GB for weights, gradients and {config.train.optimizer} state (more than 80% of "
                    f"{have_gb:.0f} GB); sharded across {world} processes: about {need_gb / world:.0f} GB each"]


def _memory_target(config: Config, device: str, world: int, sharding: str, parameters: int | None,
                   notes: list[str]) -> tuple[int, str]:
    """(processes, sharding) the memory estimate is made for: this machine's, or, planned where the preset's GPUs
    are not (hardware.gpus with hardware.gpu_memory_gb), theirs: e.g. a full fine-tune's FSDP shards across 8."""
    gpus, memory_gb = config.hardware.gpus, config.hardware.gpu_memory_gb
    if device == "cuda" or gpus < 1 or not memory_gb:
        return world, sharding
    target = Hardware(gpu_count=gpus, gpu_memory_gb=(memory_gb,) * gpus, bf16=True)
    world = gpus * config.distributed.nodes
    sharding, why = choose_sharding(config, target, "cuda", world, parameters)
    notes.append(f"memory: planned for {world} x {memory_gb:g} GB GPUs (hardware.gpus), not this machine: "
                 + ("; ".join(why) if why else f"sharding {sharding}"))
    return world, sharding


def _deepspeed_problems(config: Config, precision: str) -> list[str]:
    """What DeepSpeed ZeRO (trainer.engine.parallel.deepspeed) cannot run, each with the way out."""
    out = []  # a missing deepspeed package is a config problem (trainer.core.config.extras)
    key = "distributed.sharding: deepspeed"
    family_problem = spec_of(config.model.family).sharding_problem("deepspeed")
    if family_problem:
        out.append(family_problem)
    elif config.method != "full":
        out.append(f"{key} is for full fine-tunes (method=full): a LoRA's optimizer state is small, there is "
                   "nothing worth partitioning; use sharding=auto")
    if precision == "fp16":
        out.append(f"{key} runs with precision bf16 or fp32 (fp16's loss scaling would be DeepSpeed's, not ours): "
                   "set precision=bf16")
    if config.full.ema and config.method == "full":
        out.append(f"full.ema is not supported with {key}: set full.ema=false")
    trains_text_encoder = config.lora.train_text_encoder if config.method == "lora" else config.full.train_text_encoder
    if trains_text_encoder:
        out.append(f"{key} trains one network per run; set lora.train_text_encoder / full.train_text_encoder=false")
    if config.train.optimizer not in ("adamw", "sgd"):
        out.append(f"{key} works with train.optimizer adamw or sgd (got {config.train.optimizer})")
    return out


def make_plan(config: Config, hw: Hardware, parameters: int | None = None) -> Plan:
    """The plan for `config` on `hw`; raises ConfigError listing everything that cannot work here.
    `parameters`: the size of the network a full fine-tune trains (trainer.core.model_size), for the FSDP choice.
    Each part below decides one thing and reads alone; the problems of all of them are reported together."""
    problems: list[str] = []
    notes: list[str] = []
    device, gpu_ids, processes = _devices(config, hw, problems)
    nodes = config.distributed.nodes
    world = processes * nodes
    precision = _precision(config, hw, device, problems)
    attention = _attention(config, hw, device, notes, problems)
    fp8, fp8_notes, fp8_problems = fp8_compute(config, hw, device, gpu_ids)
    notes += fp8_notes
    problems += fp8_problems
    _optimizer(config, hw, device, notes, problems)
    per_device, auto_batch = _micro_batch(config, world, problems)
    sharding, sharding_notes = choose_sharding(config, hw, device, world, parameters)
    notes += sharding_notes
    problems += _sharding_problems(config, sharding, precision, device)
    memory_world, memory_sharding = _memory_target(config, device, world, sharding, parameters, notes)
    memory, block_swap = plan_memory(config, hw, device, gpu_ids, precision, memory_sharding, memory_world, notes,
                                     problems)
    if problems:
        raise ConfigError(problems, "the plan")
    probe_batch = auto_batch and device == "cuda" and sharding == "ddp"
    if auto_batch:
        notes.append("batch.per_device auto: " + (
            "the workers try the real step at growing micro-batches before training and keep the largest that "
            "fits" if probe_batch else "1 on the CPU" if device == "cpu" else
            f"1 under {sharding} (the probe runs before the modules are sharded)"))
    total, per_device, accumulation, batch_notes = resolve_batch(config.batch.total, per_device, world)
    compiled_note = compile_note(config, per_device)
    return Plan(
        device=device,
        gpu_ids=gpu_ids,
        nodes=nodes,
        processes_per_node=processes,
        per_device=per_device,
        accumulation=accumulation,
        total=total,
        precision=precision,
        attention=attention,
        steps=config.train.steps,
        notes=tuple(notes + batch_notes + ([compiled_note] if compiled_note else [])),
        sharding=sharding,
        zero_stage=config.distributed.zero_stage if sharding == "deepspeed" else 0,
        probe_batch=probe_batch,
        data_workers=resolve_data_workers(config.data.workers, device, hw.cpu_count, processes),
        fp8_compute=fp8,
        block_swap=block_swap,
        memory=memory.line() if memory else "",
        channels_last=channels_last(config, device),
    )


def _devices(config: Config, hw: Hardware, problems: list[str]) -> tuple[str, tuple[int, ...], int]:
    """(device "cuda" | "cpu", the GPU ids, processes per node) for `devices`."""
    try:
        kind, value = parse_devices(config.devices)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    gpu_ids: tuple[int, ...] = ()
    if kind == "auto":
        kind, value = ("gpus", hw.gpu_count) if hw.gpu_count else ("cpu", 1)
    if kind == "gpus":
        assert isinstance(value, int)  # parse_devices pairs each kind with one type of value
        if value > hw.gpu_count:
            problems.append(
                f"devices: asks for {value} GPUs but this machine has {hw.gpu_count}; use devices=auto, "
                f"a smaller count, or cpu:N"
            )
        gpu_ids = tuple(range(value))
    elif kind == "gpu_ids":
        assert isinstance(value, list)
        missing = [i for i in value if i >= hw.gpu_count]
        if missing:
            problems.append(f"devices: GPU ids {missing} do not exist here (this machine has {hw.gpu_count} GPUs)")
        gpu_ids = tuple(value)
    if kind == "cpu":
        assert isinstance(value, int)
        return "cpu", gpu_ids, value
    return "cuda", gpu_ids, len(gpu_ids)


def _precision(config: Config, hw: Hardware, device: str, problems: list[str]) -> str:
    precision = config.precision
    if precision == "auto":
        return ("bf16" if hw.bf16 else "fp16") if device == "cuda" else "fp32"
    if precision == "bf16" and device == "cuda" and not hw.bf16:
        problems.append("precision: bf16 is not supported by these GPUs (it needs compute capability 8.0+); use fp16")
    return precision


def _attention(config: Config, hw: Hardware, device: str, notes: list[str], problems: list[str]) -> str:
    attention = config.attention
    if attention != "sdpa" and not spec_of(config.model.family).xformers:
        if attention == "xformers":
            notes.append(f"attention: {config.model.family} runs PyTorch SDPA (its flash and memory-efficient "
                         "kernels); xformers applies to the UNet families only")
        return "sdpa"
    if attention == "auto":
        return "xformers" if device == "cuda" and hw.xformers else "sdpa"
    if attention == "xformers" and not (device == "cuda" and hw.xformers):
        problems.append(
            "attention: xformers is not usable here (it needs CUDA and `pip install imagetune[xformers]` built "
            "for this torch); use attention=sdpa"
        )
    return attention


def _optimizer(config: Config, hw: Hardware, device: str, notes: list[str], problems: list[str]) -> None:
    if config.train.optimizer == "adamw8bit" and not (device == "cuda" and hw.bitsandbytes):
        problems.append(
            "train.optimizer: adamw8bit needs bitsandbytes on a CUDA GPU (`pip install imagetune[bnb]`); use adamw"
        )
    if config.train.optimizer == "prodigy" and config.train.lr < 0.1:
        notes.append(f"train.optimizer prodigy estimates its own step size; train.lr={config.train.lr:g} multiplies "
                     "it (1.0 is usual), so this run will barely move")


def _micro_batch(config: Config, world: int, problems: list[str]) -> tuple[int, bool]:
    """(batch.per_device as asked, or 1 for `auto`, whether it is `auto`)."""
    per_device = config.batch.per_device
    auto_batch = per_device == "auto"
    if auto_batch:
        per_device = 1  # what fits is found by the workers on the GPU (trainer.engine.batch_probe); 1 is always safe
    assert isinstance(per_device, int), "validate() accepts no text but auto"
    if config.batch.total < world:
        problems.append(
            f"batch.total: {config.batch.total} is smaller than the {world} processes of this plan; each process "
            f"needs at least one sample per step: raise batch.total to {world} or more, or use fewer devices"
        )
    return per_device, auto_batch


def _sharding_problems(config: Config, sharding: str, precision: str, device: str) -> list[str]:
    problems = []
    if sharding == "fsdp":
        family_problem = spec_of(config.model.family).sharding_problem("fsdp")
        if family_problem:
            problems.append(family_problem)
        elif config.method != "full":
            problems.append("distributed.sharding: fsdp is for full fine-tunes (method=full); a LoRA's base "
                            "weights are frozen and small next to activations: use sharding=auto or ddp")
        if config.train.optimizer not in ("adamw", "sgd"):
            problems.append(f"train.optimizer: {config.train.optimizer} is not supported with distributed.sharding="
                            "fsdp (its state and step are not written for sharded parameters): use adamw or sgd")
        if config.full.ema:
            problems.append("full.ema is not supported with distributed.sharding=fsdp yet: set full.ema=false, "
                            "or sharding=ddp if the model fits on one GPU")
    if sharding == "deepspeed":
        problems += _deepspeed_problems(config, precision)
    for compiled in (sharding_problem(config, sharding, chosen=config.distributed.sharding == "auto"),
                     toolchain_problem(config, device)):
        if compiled:
            problems.append(compiled)
    return problems


def resolve_data_workers(workers: int | str, device: str, cpu_count: int, processes: int) -> int:
    """Input processes per training process for data.workers (`auto`: none on the CPU, where the training
    processes use every core; on GPUs up to 4, leaving each training process a core of its own)."""
    if workers != "auto":
        assert isinstance(workers, int), "validate() accepts no text but auto"
        return workers
    return 0 if device == "cpu" else max(0, min(4, cpu_count // max(1, processes) - 1))
