"""Kubernetes (trainer.core.kubernetes, docker/k8s/imagetune-job.yaml): in an indexed Job's pod, the node rank,
the node count and node 0's address come from the pod's variables, as the manifest sets them; they reach the plan
line as SLURM's do. Two pods' environments train on loopback in tests/test_slurm.py, beside SLURM's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from PIL import Image

import launch
from trainer.core.kubernetes import kubernetes_pod
from trainer.errors import UserError

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "docker" / "k8s" / "imagetune-job.yaml"
TINY_SD = REPO / "trainer" / "assets" / "tiny-sd"  # the demo's base, shipped: nothing to build


def pod_env(index: int) -> dict[str, str]:
    """What the example manifest's pod `index` sees: its env list, plus what Kubernetes adds (the completion
    index, the downward API's job name)."""
    service, job = yaml.safe_load_all(MANIFEST.read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert job["spec"]["completionMode"] == "Indexed" and env["IMAGETUNE_NODES"] == str(job["spec"]["completions"])
    assert env["IMAGETUNE_SERVICE"] == service["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"]
    return {**env, "JOB_COMPLETION_INDEX": str(index), "JOB_NAME": job["metadata"]["name"]}


def test_the_manifests_pods_map_to_node_ranks_and_pod_0s_dns_name():
    pod = kubernetes_pod(pod_env(1))
    assert pod is not None
    assert pod.overrides() == ["distributed.nodes=2", "distributed.node_rank=1",
                               "distributed.master_addr=imagetune-lora-0.imagetune-lora",
                               "distributed.master_port=29500", "devices=8"]
    assert pod.describe() == ("Kubernetes job imagetune-lora: node 1 of 2, master imagetune-lora-0.imagetune-lora, "
                              "8 GPUs per node")
    assert kubernetes_pod({"JOB_COMPLETION_INDEX": "0"}) is None and kubernetes_pod({}) is None  # not multi-node
    assert kubernetes_pod({**pod_env(0), "IMAGETUNE_MASTER_ADDR": "10.0.0.7"}).master_addr == "10.0.0.7"


@pytest.mark.parametrize("change, words", [
    ({"JOB_COMPLETION_INDEX": "2"}, "must be below the node count"),
    ({"IMAGETUNE_NODES": "two"}, "is not a whole number"),
    ({"IMAGETUNE_SERVICE": ""}, "needs node 0's address"),
])
def test_a_pod_whose_variables_do_not_add_up_is_told_what_to_set(change, words):
    with pytest.raises(UserError, match=words):
        kubernetes_pod({**pod_env(0), **change})


def test_the_plan_line_says_the_pods_place_and_the_command_line_still_wins(tmp_path, monkeypatch, capsys):
    for name, value in pod_env(1).items():
        monkeypatch.setenv(name, value)
    for i in range(2):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{i}.png")
    code = launch.main(["--preset", "demo", f"model.path={TINY_SD}", f"data.path={tmp_path}", "data.resolution=32",
                        "data.instance_prompt=a square", "devices=cpu:1", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    plan = next(line for line in out.splitlines() if line.startswith("plan: "))
    assert "2 nodes x 1 process" in plan and "Kubernetes job imagetune-lora: node 1 of 2" in plan
    assert "node_rank: 1" in out and "master_addr: imagetune-lora-0.imagetune-lora" in out
