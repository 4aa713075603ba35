"""A stand-in for trainer.engine.worker in the launcher tests: real processes and real gloo collectives, no model.

    python -m tests.fake_worker RUN_DIR [--resume CHECKPOINT_DIR]

It follows the worker contract: reads RUN_DIR/plan.json and config.yaml, global rank 0 writes progress /
checkpoint events and exactly one final event, it stops (checkpoint, `stopped`) on RUN_DIR/STOP or
SIGTERM/SIGINT, agreeing on the step through an all-reduce, and each rank keeps the real worker's heartbeat
(trainer.engine.heartbeat) so the launcher's stall watch sees it as it sees a real run. Every rank records what it saw in
RUN_DIR/fake_ranks/<rank>.json (world size, node), so tests can check the rank layout.

Environment knobs:
  FAKE_WORKER_STEP_S   seconds per step (default 0.02)
  FAKE_WORKER_CRASH    "RANK:STEP[:kill|exit]": that global rank SIGKILLs itself (or raises) at that step
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from trainer.core.events import CheckpointEvent, DoneEvent, EventLog, ProgressEvent, StoppedEvent
from trainer.engine.heartbeat import Heartbeat


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    run_dir = args.run_dir
    plan = json.loads((run_dir / "plan.json").read_text())
    config = OmegaConf.load(run_dir / "config.yaml")
    steps = int(plan["steps"])
    every = int(config.checkpoint.every)

    signalled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _f: signalled.append(signum))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    (run_dir / "fake_ranks").mkdir(exist_ok=True)
    (run_dir / "fake_ranks" / f"{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world, "local_rank": local_rank, "node_rank": int(os.environ["GROUP_RANK"]),
        "pid": os.getpid(),
    }))
    print(f"fake worker rank {rank}/{world} starting", flush=True)

    crash = os.environ.get("FAKE_WORKER_CRASH", "")
    crash_rank, crash_step, crash_mode = (crash.split(":") + ["kill"])[:3] if crash else (-1, -1, "")
    step_s = float(os.environ.get("FAKE_WORKER_STEP_S", "0.02"))
    log = EventLog(run_dir) if rank == 0 else None

    step = int(re.search(r"(\d+)$", args.resume.name).group(1)) if args.resume else 0
    heartbeat = Heartbeat(run_dir, rank, lambda: f"step {step + 1}").start(step)
    start = time.time()
    while step < steps:
        if rank == int(crash_rank) and step == int(crash_step):
            print(f"rank {rank}: crashing on purpose at step {step}", flush=True)
            if crash_mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fake failure on rank {rank} at step {step}")
        time.sleep(step_s)
        # Sum of ranks proves every process took part; the stop flag travels in the same all-reduce.
        stop = (run_dir / "STOP").exists() or bool(signalled)
        t = torch.tensor([float(rank), float(stop)])
        dist.all_reduce(t)
        assert t[0].item() == world * (world - 1) / 2
        step += 1
        heartbeat.stepped(step)
        stopping = t[1].item() > 0
        if log:
            rate = step / max(time.time() - start, 1e-6)
            log.emit(ProgressEvent(step=step, steps=steps, loss=1.0 / step, lr=1e-4, extra={"world_size": world},
                                   samples_per_s=rate * plan["total"], eta_s=(steps - step) / rate))
        if stopping or (every and step % every == 0 and step < steps):
            path = save_checkpoint(run_dir, step, rank)
            if log:
                log.emit(CheckpointEvent(step=step, path=str(path.relative_to(run_dir))))
            if stopping:
                if log:
                    log.emit(StoppedEvent(step=step, checkpoint=str(path.relative_to(run_dir))))
                dist.destroy_process_group()
                return 0
    if log:
        log.emit(DoneEvent(step=step, outputs=[]))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def save_checkpoint(run_dir: Path, step: int, rank: int) -> Path:
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    if rank == 0:
        tmp = final.with_name(f".tmp-{final.name}")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "state.json").write_text(json.dumps({"step": step}))
        (tmp / "COMPLETE").touch()
        os.replace(tmp, final)
    dist.barrier()
    return final


if __name__ == "__main__":
    try:
        code = main()
    except Exception:
        # A crash on purpose ends with exit status 1, as the real worker's does. Leaving it to the interpreter's
        # teardown, with gloo's process group still alive, ended some runs with SIGABRT (-6) instead (flaky:
        # 2 of 5 runs of test_a_one_process_run_is_its_worker_without_torchrun).
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown of torch (over a second per process on a busy 2-core machine): the
    # test-suite launches many of these.
    os._exit(code)
