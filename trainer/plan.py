"""The plan: how a config runs on this machine. A pure function of (Config, Hardware), torch-free.

`batch.total` is the effective batch of one optimizer step on any number of devices;
accumulation = total / (per_device x world_size). Steps, schedules and epochs count optimizer steps, so the
same preset trains the same way on 1, 2 or 8 processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainer.config.schema import Config
from trainer.config.validate import parse_devices
from trainer.errors import ConfigError
from trainer.hardware import Hardware


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
        return (
            f"{head} x {self.per_device} per device x accumulation {self.accumulation} = batch {self.total}"
            f" · {self.precision} · {self.attention} · {where}"
        )

    def event(self) -> dict:
        """The fields of the run's first event (`plan`)."""
        data = asdict(self)
        data.update(
            world_size=self.world_size,
            devices="cpu" if self.device == "cpu" else list(self.gpu_ids),
            line=self.line(),
            notes=list(self.notes),
        )
        return data

    @classmethod
    def from_event(cls, event: dict) -> "Plan":
        names = cls.__dataclass_fields__.keys()
        data = {k: event[k] for k in names if k in event}
        data["gpu_ids"] = tuple(data.get("gpu_ids", ()))
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)


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


def make_plan(config: Config, hw: Hardware) -> Plan:
    """The plan for `config` on `hw`; raises ConfigError listing everything that cannot work here."""
    problems: list[str] = []
    notes: list[str] = []
    try:
        kind, value = parse_devices(config.devices)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None

    gpu_ids: tuple[int, ...] = ()
    if kind == "auto":
        kind, value = ("gpus", hw.gpu_count) if hw.gpu_count else ("cpu", 1)
    if kind == "gpus":
        if value > hw.gpu_count:
            problems.append(
                f"devices: asks for {value} GPUs but this machine has {hw.gpu_count}; use devices=auto, "
                f"a smaller count, or cpu:N"
            )
        gpu_ids = tuple(range(value))
    elif kind == "gpu_ids":
        missing = [i for i in value if i >= hw.gpu_count]
        if missing:
            problems.append(f"devices: GPU ids {missing} do not exist here (this machine has {hw.gpu_count} GPUs)")
        gpu_ids = tuple(value)
    device = "cpu" if kind == "cpu" else "cuda"
    processes = value if kind == "cpu" else len(gpu_ids)
    nodes = config.distributed.nodes
    world = processes * nodes

    precision = config.precision
    if precision == "auto":
        precision = ("bf16" if hw.bf16 else "fp16") if device == "cuda" else "fp32"
    elif precision == "bf16" and device == "cuda" and not hw.bf16:
        problems.append("precision: bf16 is not supported by these GPUs (it needs compute capability 8.0+); use fp16")

    attention = config.attention
    if attention == "auto":
        attention = "xformers" if device == "cuda" and hw.xformers else "sdpa"
    elif attention == "xformers" and not (device == "cuda" and hw.xformers):
        problems.append(
            "attention: xformers is not usable here (it needs CUDA and `pip install imagetune[xformers]` built "
            "for this torch); use attention=sdpa"
        )
    if config.train.optimizer == "adamw8bit" and not (device == "cuda" and hw.bitsandbytes):
        problems.append(
            "train.optimizer: adamw8bit needs bitsandbytes on a CUDA GPU (`pip install imagetune[bnb]`); use adamw"
        )

    per_device = config.batch.per_device
    if per_device == "auto":
        # Finding the largest micro-batch that fits needs the model on the GPU; until then 1 is always safe.
        notes.append("batch.per_device auto: using 1 (searching the largest batch that fits is not supported yet)")
        per_device = 1
    total = config.batch.total
    if total < world:
        problems.append(
            f"batch.total: {total} is smaller than the {world} processes of this plan; each process needs at "
            f"least one sample per step: raise batch.total to {world} or more, or use fewer devices"
        )
    if problems:
        raise ConfigError(problems, "the plan")
    total, per_device, accumulation, batch_notes = resolve_batch(total, per_device, world)
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
        notes=tuple(notes + batch_notes),
    )
