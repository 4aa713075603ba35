"""SLURM (trainer.core.slurm): inside `srun`, the nodes, this node's rank, the master host and the GPUs come from
SLURM's variables. Here two "nodes" are two launchers on 127.0.0.1 whose environments are what srun gives the
tasks of a two-node step (and, the same way, what a Kubernetes indexed Job gives two pods: trainer.core.kubernetes);
they train to `done` with the weights of one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.engine_helpers import BASE, assert_same_weights, engine_config, final_weights, launch, log_of
from trainer.core.events import read_events
from trainer.core.slurm import expand_nodelist, slurm_step
from trainer.errors import UserError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a[1-2],b3,c[009-010]", ["a1", "a2", "b3", "c009", "c010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("dgx-[1,3]-ib", ["dgx-1-ib", "dgx-3-ib"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_the_node_list_expands_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-03", "node[a-b]", "node01]", ""])
def test_a_node_list_that_does_not_parse_is_named(nodelist):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(nodelist)


def _srun_env(node: int, nodes: int = 2, **extra: str) -> dict[str, str]:
    """What srun --nodes=N --ntasks-per-node=1 sets for the task on node `node` (the variables read)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes),
            "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_JOB_NODELIST": "127.0.0.[1-2]", **extra}


def test_a_job_step_fills_the_distributed_keys_and_outside_srun_nothing_changes():
    step = slurm_step(_srun_env(1, SLURM_GPUS_ON_NODE="4", SLURM_JOB_NODELIST="node[03-04]"))
    assert step is not None
    assert step.overrides() == ["distributed.nodes=2", "distributed.node_rank=1", "distributed.master_addr=node03",
                                "devices=4"]
    assert step.describe() == "SLURM job 4242: node 1 of 2, master node03, 4 GPUs per node"
    batch_shell = {k: v for k, v in _srun_env(0).items() if k != "SLURM_STEP_ID"}  # sbatch's script, not a step
    assert slurm_step(batch_shell) is None and slurm_step({}) is None
    with pytest.raises(UserError, match="--ntasks-per-node=1"):  # one task per GPU would start N torchruns
        slurm_step(_srun_env(0, SLURM_NTASKS="8"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pod_env(node: int) -> dict[str, str]:
    """What pod `node` of docker/k8s/imagetune-job.yaml sees, with node 0's address made this machine's (the
    manifest's DNS name of pod 0 resolves only inside the cluster)."""
    from tests.test_kubernetes import pod_env

    return {**pod_env(node), "IMAGETUNE_MASTER_ADDR": "127.0.0.1"}


# Each scheduler's variables for the task on node N, and what the plan line says of that node.
SCHEDULERS = {
    "slurm": (_srun_env, "SLURM job 4242: node {node} of 2, master 127.0.0.1"),
    "kubernetes": (_pod_env, "Kubernetes job imagetune-lora: node {node} of 2, master 127.0.0.1"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_sd_path, demo_data_path):
    """One process x 4 per device: the weights both nodes' processes must reach together."""
    run_dir, final = launch(tmp_path_factory.mktemp("reference"), engine_config(
        tiny_sd_path, demo_data_path, "devices=cpu:1", "batch.per_device=4", "name=reference"))
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_two_nodes_on_loopback_train_the_weights_of_one_process(scheduler, reference, tmp_path, tiny_sd_path,
                                                                demo_data_path):
    """Two launchers on 127.0.0.1, each with the environment the scheduler gives one node's task (srun's
    variables, or an indexed Job's pod as the example manifest declares it)."""
    node_env, says = SCHEDULERS[scheduler]
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({"model": {"path": str(tiny_sd_path)}, "data": {"path": str(demo_data_path)},
                                      "name": "cluster"}))
    # The preset says one node; the scheduler's variables make it two. devices and the port are the command
    # line's (the CPU stands in for each node's GPUs, and the port must be free on this machine).
    args = ["--preset", str(preset), *BASE, "devices=cpu:1", "batch.per_device=1",
            f"distributed.master_port={_free_port()}"]
    nodes = {}
    for node in (1, 0):  # node 1 first: the ranks must not depend on who starts first
        env = {**os.environ, **node_env(node)}
        nodes[node] = subprocess.Popen([sys.executable, str(REPO / "launch.py"), *args,
                                        "--runs-dir", str(tmp_path / f"node{node}")], env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = {node: proc.communicate(timeout=500)[0] for node, proc in nodes.items()}
    for node, proc in nodes.items():
        assert proc.returncode == 0, printed[node][-3000:]
        assert says.format(node=node) in printed[node]  # on the plan line
        assert "plan: 2 nodes x 1 process" in printed[node]
    node0 = tmp_path / "node0" / "cluster"
    events = read_events(node0)
    assert events[0]["world_size"] == 2 and events[0]["cluster"].startswith(says.format(node=0)[:16])
    assert events[-1]["type"] == "done"
    assert_same_weights(final_weights(reference), final_weights(node0))
