"""Inside a Kubernetes indexed Job (docker/k8s/imagetune-job.yaml): the multi-node settings from the pod's variables.

One pod per node, as one srun task per node under SLURM (trainer.core.slurm): each runs launch.py, which starts
torchrun with one process per GPU. An indexed Job gives each pod JOB_COMPLETION_INDEX (0 .. completions-1): its
node rank. What a pod cannot read about its Job, the manifest passes in the same file it is declared in:
IMAGETUNE_NODES (the Job's `completions`), JOB_NAME (the downward API's job-name label) and
IMAGETUNE_SERVICE (the headless Service whose DNS gives pod `<job>-<index>` the name
`<job>-<index>.<service>`), so node 0 is `<job>-0.<service>`; IMAGETUNE_MASTER_ADDR names it directly instead.
IMAGETUNE_GPUS_PER_NODE and IMAGETUNE_MASTER_PORT are optional. They become the same `distributed.*` and `devices`
overrides as SLURM's, placed before the command line's own KEY=VALUE, so those still win. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from trainer.core.slurm import node_overrides
from trainer.errors import UserError

INDEX = "JOB_COMPLETION_INDEX"


@dataclass(frozen=True)
class KubernetesPod:
    job: str
    nodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    gpus_per_node: int | None

    def overrides(self) -> list[str]:
        return node_overrides(self.nodes, self.node_rank, self.master_addr, self.master_port, self.gpus_per_node)

    def describe(self) -> str:
        gpus = f", {self.gpus_per_node} GPUs per node" if self.gpus_per_node else ""
        return f"Kubernetes job {self.job}: node {self.node_rank} of {self.nodes}, master {self.master_addr}{gpus}"


def kubernetes_pod(env: Mapping[str, str]) -> KubernetesPod | None:
    """This pod's place in an indexed Job, or None outside one (no JOB_COMPLETION_INDEX, or no IMAGETUNE_NODES:
    an indexed Job that is not a multi-node run, e.g. one pod per preset)."""
    if INDEX not in env or "IMAGETUNE_NODES" not in env:
        return None
    nodes = _number(env, "IMAGETUNE_NODES")
    rank = _number(env, INDEX)
    if nodes < 1 or rank >= nodes:
        raise UserError(f"{INDEX}={rank} with IMAGETUNE_NODES={nodes}: the index must be below the node count. Set "
                        "IMAGETUNE_NODES to the Job's `completions` (and `parallelism`).")
    job = env.get("JOB_NAME", "").strip()
    master = env.get("IMAGETUNE_MASTER_ADDR", "").strip()
    if not master:
        service = env.get("IMAGETUNE_SERVICE", "").strip()
        if not (job and service):
            raise UserError("A multi-node Kubernetes Job needs node 0's address: set IMAGETUNE_MASTER_ADDR, or "
                            "JOB_NAME (the downward API's batch.kubernetes.io/job-name label) and IMAGETUNE_SERVICE "
                            "(the headless Service named in the pod's `subdomain`), as docker/k8s/imagetune-job.yaml "
                            "does.")
        master = f"{job}-0.{service}"
    port = _number(env, "IMAGETUNE_MASTER_PORT") if env.get("IMAGETUNE_MASTER_PORT", "").strip() else None
    gpus = _number(env, "IMAGETUNE_GPUS_PER_NODE") if env.get("IMAGETUNE_GPUS_PER_NODE", "").strip() else None
    return KubernetesPod(job=job or "?", nodes=nodes, node_rank=rank, master_addr=master, master_port=port,
                         gpus_per_node=gpus or None)


def _number(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not value.isdigit():
        raise UserError(f"{name}={value!r} is not a whole number; check the Job's env in its manifest.")
    return int(value)
