"""One training process (a rank). Started by torchrun through trainer.core.launcher, never by hand:

    python -m trainer.engine.torchrun ... -m trainer.engine.worker RUN_DIR [--resume CHECKPOINT_DIR]

(a one-process run starts `python -u -m trainer.engine.worker RUN_DIR ...` itself, with torchrun's environment).

setup (accelerator, family, data, optimizer, resume) -> loop.fit -> the final event. Global rank 0 writes
events; a user's mistake found here still ends as one `failed` event with a sentence to act on.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import trainer.families  # noqa: F401  (fills the family registry, trainer.core.registry)
from trainer.core.config.load import load_config
from trainer.errors import UserError
from trainer.core.events import DoneEvent, Event, EventLog, FailedEvent, StoppedEvent, WarningEvent
from trainer.core.runfolder import RunFolder
from trainer.core.runlog import worker_echo
from trainer.core.plan import Plan
from trainer.engine.chatter import quiet_library_chatter


class _Silent:
    """Events of ranks other than 0 go nowhere: one writer per file."""

    def emit(self, typed: Event) -> dict:
        return {}


def setup(run_dir: Path, resume: Path | None):
    import torch

    from trainer.core.data.stream import make_stream
    from trainer.families import get_family
    from trainer.families.protocol import Bucketed, WorkerContext
    from trainer.engine.compile import NoCompile, compile_network
    from trainer.engine.run import Run
    from trainer.engine.ema import build_ema
    from trainer.engine.optim import build_optimizer, build_scheduler, describe as describe_optimizer
    from trainer.engine.precision import Amp
    from trainer.engine.run_io import load_run_checkpoint, load_weights
    from trainer.engine.parallel import for_plan
    from trainer.core.stopping import StopRequest

    folder = RunFolder(run_dir)
    config = load_config(folder.config, check_paths=False)
    plan = Plan.from_event(folder.read_plan())
    stop = StopRequest(run_dir)
    stop.install_signal_handlers()
    # Precision is ours (trainer.engine.precision), so accelerate runs "no" mixed precision; it does DDP and accumulation.
    acc = _accelerator(config, plan)
    if acc.num_processes != plan.world_size:
        raise RuntimeError(f"launched {acc.num_processes} processes but the plan says {plan.world_size}")
    events = EventLog(run_dir, echo=worker_echo(run_dir)) if acc.is_main_process else _Silent()

    def log_warning(message: str) -> None:
        events.emit(WarningEvent(message=message))  # and its line in train.log (the echo)

    if plan.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    else:
        # cuDNN's fused attention (one of SDPA's backends) crashed FLUX's backward with an illegal memory access on
        # an H200 (torch 2.11, cuDNN 9.19; bench/README.md); flash and memory-efficient attention are as fast.
        torch.backends.cuda.enable_cudnn_sdp(False)
    parallel = for_plan(plan, acc)
    ctx = WorkerContext(config=config, plan=plan, run_dir=run_dir, cache_dir=run_dir.parent / ".cache",
                        device=acc.device, rank=acc.process_index, world_size=acc.num_processes,
                        accelerator=acc, log_warning=log_warning, unwrap=parallel.unwrap)
    family = get_family(config.model.family)(ctx)
    family.load()
    items = family.prepare_data()
    if plan.probe_batch:  # batch.per_device auto on GPUs: before DDP wraps the modules (trainer.engine.batch_probe)
        plan = _probe_batch(family, items, plan, config, acc)
        ctx.plan = plan
        acc.gradient_accumulation_steps = plan.accumulation
        log_warning(plan.notes[-1])
    stream = make_stream(items, item_buckets=family.item_buckets if isinstance(family, Bucketed) else None, total=plan.total,
                         per_device=plan.per_device, world_size=plan.world_size, seed=config.seed)
    if resume:
        load_weights(family, resume)  # before DDP wraps the modules (DDP then broadcasts rank 0's weights)
    parallel.shard(family)  # FSDP replaces the parameters by their shards: before the optimizer takes them
    optimizer = build_optimizer(family.param_groups(), config.train)
    if acc.is_main_process:
        print(f"optimizer: {describe_optimizer(optimizer)}", flush=True)  # the kernel chosen (trainer.engine.optim)
    scheduler = build_scheduler(optimizer, config.train)
    ema = build_ema(config, (p for g in optimizer.param_groups for p in g["params"]))
    compiler: NoCompile = NoCompile()
    if config.train.compile:  # after the adapters (compiled in the blocks) and the batch probe (no compile per size)
        compiler = compile_network(family, plan, log_warning, main=acc.is_main_process)
    parallel.wrap(family, acc, optimizer)  # DDP / DeepSpeed wrap the trainable modules (FSDP: nothing to do)
    run = Run(config=config, plan=plan, accelerator=acc, family=family, stream=stream, optimizer=optimizer,
              scheduler=scheduler, amp=Amp(plan.precision, acc.device.type), events=events, stop=stop,
              run_dir=run_dir, ema=ema, parallel=parallel, compiler=compiler)
    family.ema = ema
    from trainer.engine.input import InputPipeline

    run.input = InputPipeline(stream, family, rank=acc.process_index, steps=plan.steps,
                              accumulation=plan.accumulation, workers=plan.data_workers, pin=plan.device == "cuda")
    if resume:
        load_run_checkpoint(run, resume)
    if acc.is_main_process:  # logging.tensorboard / logging.wandb: mirrors of rank 0's events (trainer.engine.mirrors)
        from trainer.engine.mirrors import open_mirrors

        run.events = open_mirrors(events, config, run_dir, run.state.step, resumed=resume is not None)
    from trainer.engine.heartbeat import Heartbeat

    run.heartbeat = Heartbeat(run_dir, acc.process_index, lambda: compiler.phase(run.phase)).start(run.state.step)
    return run


def _probe_batch(family, items: int, plan, config, acc):
    """The plan with batch.per_device auto resolved on this machine's GPUs."""
    import torch

    from trainer.core.data.stream import make_stream
    from trainer.engine.batch_probe import probe_per_device
    from trainer.engine.precision import Amp
    from trainer.families.protocol import Bucketed, Sample

    amp = Amp(plan.precision, acc.device.type)
    buckets = family.item_buckets if isinstance(family, Bucketed) else None

    def run_loss(size: int):
        # Step 0's samples of this rank at `size` per device: real images (one bucket), the real loss.
        stream = make_stream(items, item_buckets=buckets, total=plan.total, per_device=size,
                             world_size=plan.world_size, seed=config.seed)
        samples = [Sample(pos, *stream.item(pos)) for pos in stream.positions(0, 0, acc.process_index)]
        with amp.autocast():
            return family.loss(samples)

    def agree(size: int) -> int:
        if acc.num_processes == 1:
            return size
        found = torch.tensor([size], device=acc.device)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MIN)
        return int(found.item())

    params = [p for m in family.trainable_modules() for p in m.parameters() if p.requires_grad]
    return probe_per_device(run_loss, params, plan, agree)


def _accelerator(config, plan):
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cpu = plan.device == "cpu"
    timeout = timedelta(seconds=config.distributed.timeout_s)
    if plan.sharding != "deepspeed":
        return Accelerator(cpu=cpu, gradient_accumulation_steps=plan.accumulation,
                           kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    from accelerate.utils import DeepSpeedPlugin

    from trainer.engine.parallel.deepspeed import deepspeed_config, skip_cpu_shm_kernel

    if cpu:
        skip_cpu_shm_kernel()  # before accelerate starts DeepSpeed's communication backend, which would build it
    # accelerate drops the DeepSpeed plugin without a word when cpu=True; on CPU processes it runs DeepSpeed's
    # CPU accelerator, and needs the gloo backend named (otherwise every rank takes itself for rank 0).
    return Accelerator(gradient_accumulation_steps=plan.accumulation,
                       deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=deepspeed_config(config, plan)),
                       kwargs_handlers=[InitProcessGroupKwargs(backend="gloo" if cpu else None, timeout=timeout)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", type=Path, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    run = None
    import os

    is_rank0 = os.environ.get("RANK", "0") == "0"
    events = EventLog(run_dir, echo=worker_echo(run_dir)) if is_rank0 else _Silent()
    quiet_library_chatter(run_dir)
    try:
        run = setup(run_dir, args.resume)
        events = run.events  # from here on, the final event reaches the TensorBoard / W&B mirrors too
        from trainer.engine.loop import fit

        status = fit(run)
        if status == "stopped":
            from trainer.core.checkpoint import latest_checkpoint

            ckpt = latest_checkpoint(run_dir)
            events.emit(StoppedEvent(step=run.state.step, reason=run.stop.reason(),
                                     checkpoint=str(ckpt.path.relative_to(run_dir)) if ckpt else None))
            return 0
        from trainer.engine.ema import ema_weights
        from trainer.engine.optim import averaged_weights

        outputs = []
        # FSDP: rank 0 writes gathered weights; an EMA run, its averaged ones
        with averaged_weights(run.optimizer), ema_weights(run), run.parallel.gathered():
            if run.accelerator.is_main_process:
                run.phase = "rank 0 writing the outputs"
                outputs = run.family.save_outputs(RunFolder(run_dir).output, step=run.state.step)
                outputs = [os.path.relpath(p, run_dir) for p in outputs]
            run.accelerator.wait_for_everyone()
        hub = _push_to_hub(run, events) if run.accelerator.is_main_process and run.config.output.push_to_hub else None
        events.emit(DoneEvent(step=run.state.step, outputs=outputs, hub=hub or None, extra={
            "overflow_steps": run.amp.overflow_steps, "nonfinite_steps": run.state.nonfinite_total}))
        return 0
    except UserError as exc:
        events.emit(FailedEvent(reason=str(exc)))
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        from trainer.engine.run import RunFailed

        traceback.print_exc()
        phase = run.phase if run else "setting up"
        if isinstance(exc, RunFailed):  # decided on every rank alike: the run's own final word
            assert run is not None, "only a built Run raises RunFailed"
            events.emit(FailedEvent(reason=str(exc), step=run.state.step))
        elif _is_timeout(exc):
            events.emit(FailedEvent(step=run.state.step if run else None, reason=(
                f"A process waited longer than distributed.timeout_s while the run was at {phase}: another process "
                f"probably crashed or hung there. See train.log for its last lines.")))
        else:
            # A crash (here, or a peer's death seen as a broken connection): the launcher names the rank
            # that failed first, from torchrun's report (or this process's exit status), in the final `failed` event.
            events.emit(WarningEvent(message=f"rank 0 stopped at {phase}: {type(exc).__name__}: {exc}"))
        return 1
    finally:
        if hasattr(events, "close"):  # a mirror still open after a crash: flush TensorBoard, finish the W&B run
            events.close()


def _push_to_hub(run, events) -> str | None:
    """output.push_to_hub, on rank 0 once the outputs are written (the other ranks have nothing left to do): the
    repo's URL, or None after a `warning` (the run is still done; its files are in output/)."""
    from trainer.core.hub import push_outputs

    repo = run.config.output.push_to_hub
    run.phase = f"rank 0 uploading the outputs to {repo}"
    print(f"uploading the outputs to the Hub repo {repo}", flush=True)
    try:
        return push_outputs(run.config, run.run_dir, run.state.step)
    except Exception as exc:  # network, permissions, quota: the training itself succeeded
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        events.emit(WarningEvent(message=f"output.push_to_hub: uploading to {repo} failed ({type(exc).__name__}: "
                                       f"{first}); the outputs are in output/. Check HF_TOKEN (a write token) and "
                                       f"the repo id, then: python launch.py --push-to-hub {run.run_dir}"))
        return None


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text


def exit_now(code: int) -> None:
    """End the process once main() has returned: everything the run leaves (events, checkpoints, outputs) is
    written and closed by then, and every rank has passed its last collective. The interpreter's own teardown of
    torch, diffusers and transformers (freeing thousands of modules) would keep the process, and so the run, alive
    for another 1-2 s on a 2-core CPU, with nothing left to do."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # A failing rank ends the same way: its traceback and events are written, and the interpreter's teardown with
    # a live process group sometimes turned its exit 1 into SIGABRT. Which rank failed first is read from
    # torchrun's summary, preferring a rank killed by a signal (trainer.core.failures.parse_root_cause), so a
    # consequent error exit racing the killed rank's no longer decides the report.
    exit_now(main())
