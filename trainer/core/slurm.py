"""Inside a SLURM job step (`srun python launch.py --preset ...`): the multi-node settings from SLURM's variables.

One launcher per node (`srun --ntasks-per-node=1`): each starts torchrun with one process per GPU, as on any
machine. SLURM says how many nodes there are (SLURM_NNODES), which one this is (SLURM_NODEID), which hosts
(SLURM_JOB_NODELIST, compressed as `node[01-03,07]`; node 0 of the list is the master) and how many GPUs this
node was given (SLURM_GPUS_ON_NODE). They become `distributed.*` and `devices` overrides placed before the
command line's own KEY=VALUE, so those still win. Torch-free: launch.py reads it before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from trainer.errors import UserError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order: `node[01-03,07],gpu5` -> node01 node02 node03 node07
    gpu5; several bracket groups multiply (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2); zero padding is kept."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts += _expand(item, text)
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST {text!r} names no host.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise UserError(f"SLURM_JOB_NODELIST {whole!r}: unbalanced brackets in {item!r}.")
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    hosts = []
    for part in match.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None:
            raise UserError(f"SLURM_JOB_NODELIST {whole!r}: {part!r} is not a number or a range like 01-03.")
        first, last = bounds.group(1), bounds.group(2) or bounds.group(1)
        width = len(first) if first.startswith("0") else 0
        for n in range(int(first), int(last) + 1):
            hosts += _expand(f"{head}{n:0{width}d}{tail}", whole)
    return hosts


def node_overrides(nodes: int, node_rank: int, master_addr: str, master_port: int | None,
                   gpus_per_node: int | None) -> list[str]:
    """A cluster node's place as KEY=VALUE overrides, placed before the command line's own (which still win):
    what SLURM's variables and a Kubernetes pod's (trainer.core.kubernetes) both come to."""
    found = [f"distributed.nodes={nodes}", f"distributed.node_rank={node_rank}",
             f"distributed.master_addr={master_addr}"]
    if master_port:
        found.append(f"distributed.master_port={master_port}")
    if gpus_per_node:
        found.append(f"devices={gpus_per_node}")
    return found


@dataclass(frozen=True)
class SlurmStep:
    job_id: str
    nodes: int
    node_rank: int
    master_addr: str
    gpus_per_node: int | None

    def overrides(self) -> list[str]:
        """KEY=VALUE overrides (distributed.master_port stays the preset's: the same on every node)."""
        return node_overrides(self.nodes, self.node_rank, self.master_addr, None, self.gpus_per_node)

    def describe(self) -> str:
        gpus = f", {self.gpus_per_node} GPUs per node" if self.gpus_per_node else ""
        return f"SLURM job {self.job_id}: node {self.node_rank} of {self.nodes}, master {self.master_addr}{gpus}"


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """This process's place in a SLURM job step, or None outside `srun` (an sbatch script's own shell, which
    has SLURM_JOB_ID but no SLURM_STEP_ID, is not a step: it runs srun)."""
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        return None
    nodes = _number(env, "SLURM_STEP_NUM_NODES") or _number(env, "SLURM_NNODES") or 1
    tasks = _number(env, "SLURM_STEP_NUM_TASKS") or _number(env, "SLURM_NTASKS") or nodes
    if tasks != nodes:
        raise UserError(f"This SLURM step runs {tasks} tasks on {nodes} node(s); imagetune needs one per node (it "
                        "starts one process per GPU itself): srun --ntasks-per-node=1 python launch.py ...")
    hosts = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    if len(hosts) != nodes:
        raise UserError(f"SLURM lists {len(hosts)} host(s) ({', '.join(hosts)}) for {nodes} node(s).")
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    return SlurmStep(job_id=env["SLURM_JOB_ID"], nodes=nodes, node_rank=int(env["SLURM_NODEID"]),
                     master_addr=hosts[0], gpus_per_node=int(gpus) if gpus.isdigit() and int(gpus) > 0 else None)


def _number(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UserError(f"{name}={value!r} is not a whole number; is this a SLURM job step?")
    return int(value)
