#!/usr/bin/env python
"""SD 1.5 UNet training throughput, memory and MFU on one CUDA GPU: LoRA and full fine-tune.

    python bench/gpu_sd15.py [--out bench/gpu_sd15.json] [--batches 1,4,8] [--steps 20] [--peak-tflops T]
    python bench/gpu_sd15.py --dry-run-cpu        # the same code path, tiny UNet, 2 steps, on the CPU
    python bench/gpu_sd15.py --methods lora --batches 8 --levers eager,channels_last,compile,compile+channels_last

Nothing is downloaded: the UNet is diffusers' UNet2DConditionModel built from the published SD 1.5 config
(written out below) with random weights, trained at 512 px (64x64 latents) on random latents, random timesteps
and random (B, 77, 768) text-encoder states (the frozen text encoder's cost is not included). Each
configuration is what the engine does for that method:

- LoRA: frozen base weights in bf16, LoRA rank 16 (alpha 16) on to_q/to_k/to_v/to_out.0 in fp32 (peft, via
  `unet.add_adapter`);
- full: every UNet weight trainable, fp32;

both under bf16 autocast, SDPA attention, AdamW (torch's default implementation, as the engine uses), gradient
clipping at 1.0, with and without gradient checkpointing, at each batch size (a configuration that runs out of
memory is reported as OOM and skipped). Per configuration: a few warm-up steps, then `--steps` timed steps.

MFU (model FLOP utilisation) = useful training FLOPs per second / the GPU's peak dense bf16 FLOP/s. The UNet's
forward FLOPs are counted with torch.utils.flop_counter.FlopCounterMode on one forward at batch 1 (matmuls,
convolutions and attention; not elementwise ops). Two MFU columns:
- `MFU 3x`: training FLOPs = 3 x forward (the usual convention: backward ~ 2 x forward);
- `MFU counted`: the FLOPs of one real forward + backward counted the same way (about 3x forward for full
  fine-tuning; about 2.3x for LoRA, whose frozen weights need input gradients but no weight gradients).
With gradient checkpointing the recomputed forward is extra work that is not counted as useful, so MFU drops
even at equal hardware utilisation. Exit status: 0, or 2 without CUDA (unless --dry-run-cpu).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._common import compile_repeated_blocks, fmt, markdown_table, max_rss_mb  # noqa: E402

# The published SD 1.5 UNet config (stable-diffusion-v1-5/stable-diffusion-v1-5, unet/config.json), written out;
# keys not listed take diffusers' defaults, which are SD 1.5's.
SD15_UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,  # diffusers' SD 1.x naming: 8 heads (of 40/80/160 channels)
}
TEXT_TOKENS, TEXT_DIM = 77, 768

# The same architecture shrunk for --dry-run-cpu.
TINY_UNET = {**SD15_UNET, "sample_size": 16, "block_out_channels": [32, 64, 64, 64], "layers_per_block": 1,
             "norm_num_groups": 8, "cross_attention_dim": 32, "attention_head_dim": 4}
TINY_TEXT_DIM = 32

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]

# Peak dense (no sparsity) bf16 tensor FLOP/s with fp32 accumulation, from the vendors' data sheets, matched
# against torch.cuda.get_device_name() in this order (most specific first).
PEAK_BF16_TFLOPS = [
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("H20", 148.0), ("B200", 2250.0), ("B100", 1750.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("A10G", 125.0), ("A10", 125.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 6000 Ada", 364.0), ("RTX A6000", 155.0), ("RTX 4090", 165.0), ("RTX 4080", 97.0), ("RTX 3090", 71.0),
]


def peak_tflops_for(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in name.lower():
            return value
    return None


# ----------------------------------------------------------------------------------------------------------------


def build_unet(config: dict, device):
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: random init of 860M weights on the CPU takes long
        unet = UNet2DConditionModel(**config)
    unet.set_attn_processor(AttnProcessor2_0())  # SDPA
    unet.train()
    return unet


# The engine's speed levers this bench can turn, in the order they run: compiling is not undone, so the compiled
# variants come last. `channels_last` is train.channels_last (NHWC weights, which cuDNN's tensor-core convolutions
# prefer); `compile` is train.compile (regional: the UNet's repeated blocks, as trainer.engine.compile does it).
LEVERS = ("eager", "channels_last", "compile", "compile+channels_last")


def set_levers(unet, levers: str, compiled: bool) -> bool:
    """Put `unet` in the state `levers` names; returns whether its blocks are compiled now."""
    import torch

    unet.to(memory_format=torch.channels_last if "channels_last" in levers else torch.contiguous_format)
    if "compile" in levers and not compiled:
        compile_repeated_blocks(unet)
        return True
    return compiled


def inputs(batch: int, config: dict, text_dim: int, device):
    import torch

    g = torch.Generator(device).manual_seed(batch)
    size = config["sample_size"]
    latents = torch.randn(batch, 4, size, size, device=device, generator=g)
    target = torch.randn(batch, 4, size, size, device=device, generator=g)
    t = torch.randint(0, 1000, (batch,), device=device, generator=g)
    hidden = torch.randn(batch, TEXT_TOKENS, text_dim, device=device, generator=g)
    return latents, t, hidden, target


def train_step(unet, params, optimizer, batch_inputs, device_type: str) -> None:
    import torch
    import torch.nn.functional as F

    latents, t, hidden, target = batch_inputs
    with torch.autocast(device_type, dtype=torch.bfloat16):
        pred = unet(latents, t, hidden, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), target.float())
    loss.backward()
    if optimizer is not None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def count_flops(unet, params, config: dict, text_dim: int, device, *, backward: bool) -> int:
    """FLOPs of one forward (or forward + backward) at batch 1, under bf16 autocast, attention through the math
    path (plain matmuls, which FlopCounterMode counts whatever the fused kernels' registrations are)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    batch_inputs = inputs(1, config, text_dim, device)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        if backward:
            train_step(unet, params, None, batch_inputs, device.type)
        else:
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                unet(batch_inputs[0], batch_inputs[1], batch_inputs[2], return_dict=False)
    for p in params:
        p.grad = None
    return counter.get_total_flops()


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(unet, params, *, batch: int, checkpointing: bool, config: dict, text_dim: int, device, steps: int,
            warmup: int) -> dict:
    import torch

    if checkpointing:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()
    cuda = device.type == "cuda"
    optimizer = batch_inputs = result = None
    try:
        free(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        batch_inputs = inputs(batch, config, text_dim, device)
        optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=1e-2)  # the engine's optimizer (default impl)
        began = time.perf_counter()
        for _ in range(warmup):  # a compiled configuration compiles here
            train_step(unet, params, optimizer, batch_inputs, device.type)
        if cuda:
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - began
        start = time.perf_counter()
        for _ in range(steps):
            train_step(unet, params, optimizer, batch_inputs, device.type)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        result = {"status": "ok", "step_ms": 1000 * seconds / steps, "samples_per_s": batch * steps / seconds,
                  "peak_mb": peak, "warmup_s": warmup_s}
    except torch.OutOfMemoryError:
        result = {"status": "OOM"}  # cleaned up below, once the exception (and the frames it holds) is gone
    for p in params:
        p.grad = None
    del optimizer, batch_inputs
    free(device)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "gpu_sd15.json"), help="JSON results file")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,8; dry run 1,2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 20; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (default 3; dry run 1)")
    p.add_argument("--methods", default="full,lora", help="comma-separated: full, lora")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--levers", default="eager",
                   help=f"comma-separated speed levers to measure each configuration with: {', '.join(LEVERS)} "
                        "(e.g. eager,channels_last,compile: issue 15's lever on/off table)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's peak dense bf16 TFLOP/s, when its name is not in the built-in table")
    p.add_argument("--time-budget", type=float, default=330.0,
                   help="seconds; configurations not started by then are skipped (and listed as such)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run the same code on a tiny UNet on the CPU (2 steps) to check the script works")
    args = p.parse_args(argv)
    t_begin = time.perf_counter()

    import torch

    dry = args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        print("error: bench/gpu_sd15.py needs a CUDA GPU and none is visible here (torch.cuda.is_available() is "
              "False). Run it on a machine with a GPU, or use --dry-run-cpu to check the script on the CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    if dry and "OMP_NUM_THREADS" not in os.environ:
        # One thread: on a shared CPU every multi-threaded op waits for a second core that other tenants hold,
        # which made this check 50x slower here; the dry run's numbers mean nothing anyway.
        torch.set_num_threads(1)
    config, text_dim = (TINY_UNET, TINY_TEXT_DIM) if dry else (SD15_UNET, TEXT_DIM)
    batches = [int(b) for b in (args.batches or ("1,2" if dry else "1,4,8")).split(",")]
    steps = args.steps or (2 if dry else 20)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 3)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(methods) - {"full", "lora"}:
        p.error("--methods takes full and/or lora")
    levers = [lever for lever in LEVERS if lever in {x.strip() for x in args.levers.split(",")}]
    if not levers or {x.strip() for x in args.levers.split(",")} - set(LEVERS):
        p.error(f"--levers takes some of {', '.join(LEVERS)}")

    gpu = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    peak = args.peak_tflops or (None if dry else peak_tflops_for(gpu))
    notes = []
    if peak is None and not dry:
        notes.append(f"'{gpu}' is not in the peak-FLOP table: pass --peak-tflops for MFU")
    print(f"device: {gpu}; peak dense bf16: {fmt(peak, 0)} TFLOP/s; torch {torch.__version__}; "
          f"batches {batches}; {warmup} warm-up + {steps} timed steps per configuration", flush=True)

    unet = build_unet(config, device)
    n_params = sum(p.numel() for p in unet.parameters())
    forward_flops = count_flops(unet, [], config, text_dim, device, backward=False)
    print(f"UNet: {n_params / 1e6:.1f} M parameters; forward at batch 1: {forward_flops / 1e9:.1f} GFLOPs", flush=True)

    results, train_flops = [], {}
    # Full fine-tune first (fp32 weights), then the same UNet frozen in bf16 with LoRA added.
    for method in sorted(methods, key=lambda m: m != "full"):
        if method == "full":
            unet.requires_grad_(True)
        else:
            from peft import LoraConfig

            unet.requires_grad_(False)
            unet.to(torch.bfloat16)
            torch.manual_seed(0)
            unet.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                        target_modules=LORA_TARGETS))
            for q in unet.parameters():
                if q.requires_grad:
                    q.data = q.data.float()  # trained weights stay fp32, as in the engine
        params = [q for q in unet.parameters() if q.requires_grad]
        n_train = sum(q.numel() for q in params)
        unet.disable_gradient_checkpointing()
        train_flops[method] = count_flops(unet, params, config, text_dim, device, backward=True)
        print(f"{method}: {n_train / 1e6:.2f} M trainable parameters; forward + backward at batch 1: "
              f"{train_flops[method] / 1e9:.1f} GFLOPs ({train_flops[method] / forward_flops:.2f}x forward)", flush=True)
        compiled = False
        for lever, checkpointing in [(lever, c) for lever in levers for c in (False, True)]:
            compiled = set_levers(unet, lever, compiled)
            oom_at = None
            for batch in batches:
                row = {"method": method, "levers": lever, "gradient_checkpointing": checkpointing, "batch": batch}
                if oom_at is not None and batch > oom_at:
                    row.update(status="skipped", reason=f"OOM at batch {oom_at}")
                elif time.perf_counter() - t_begin > args.time_budget:
                    row.update(status="skipped", reason=f"past --time-budget {args.time_budget:.0f} s")
                else:
                    row.update(measure(unet, params, batch=batch, checkpointing=checkpointing, config=config,
                                       text_dim=text_dim, device=device, steps=steps, warmup=warmup))
                    if row["status"] == "OOM":
                        oom_at = batch
                if row["status"] == "ok" and peak:
                    useful = row["samples_per_s"] * 1e-12
                    row["mfu_3x"] = 3 * forward_flops * useful / peak
                    row["mfu_counted"] = train_flops[method] * useful / peak
                results.append(row)
                print(f"  {method:4s} {lever} gc={'on ' if checkpointing else 'off'} batch {batch}: {row['status']}"
                      + (f"  {row['samples_per_s']:.2f} samples/s  {row['step_ms']:.1f} ms/step  peak "
                         f"{fmt(row['peak_mb'], 0)} MB" if row["status"] == "ok" else f" {row.get('reason', '')}"),
                      flush=True)

    headers = ["method", "levers", "grad ckpt", "batch", "samples/s", "step ms", "peak memory MB", "MFU 3x",
               "MFU counted", "warm-up s"]
    rows = []
    for r in results:
        head = [r["method"], r["levers"], "on" if r["gradient_checkpointing"] else "off", r["batch"]]
        if r["status"] == "ok":
            rows.append(head + [fmt(r["samples_per_s"], 2), fmt(r["step_ms"], 1), fmt(r["peak_mb"], 0),
                                f"{100 * r['mfu_3x']:.1f}%" if "mfu_3x" in r else "-",
                                f"{100 * r['mfu_counted']:.1f}%" if "mfu_counted" in r else "-",
                                fmt(r["warmup_s"], 1)])
        else:
            rows.append(head + [r["status"] + (f" ({r['reason']})" if r.get("reason") else ""), "-", "-", "-", "-",
                                "-"])
    table = markdown_table(headers, rows)
    elapsed = time.perf_counter() - t_begin
    model = "tiny UNet (dry run), 128 px" if dry else "SD 1.5 UNet, 512 px"
    summary = (f"{gpu}, peak {fmt(peak, 0)} TFLOP/s bf16 dense; {model}, {n_params / 1e6:.1f} M params; "
               f"forward {forward_flops / 1e9:.1f} GFLOPs/sample; counted fwd+bwd: "
               + ", ".join(f"{m} {f / 1e9:.1f} GFLOPs ({f / forward_flops:.2f}x)" for m, f in train_flops.items())
               + f"; {elapsed:.0f} s in all")
    print()
    print(table)
    print()
    print(summary)
    if dry:
        notes.append("dry run on the CPU with a tiny UNet: checks the script, the numbers mean nothing "
                     f"(peak memory is not measured on the CPU; process max RSS {max_rss_mb():.0f} MB)")
    for note in notes:
        print(f"note: {note}")
    out = {
        "device": gpu, "peak_bf16_tflops": peak, "dry_run_cpu": dry, "torch": torch.__version__,
        "unet_config": config, "parameters": n_params, "forward_gflops_batch1": forward_flops / 1e9,
        "train_gflops_batch1": {m: f / 1e9 for m, f in train_flops.items()}, "lora_rank": args.lora_rank,
        "lora_targets": LORA_TARGETS, "levers": levers, "steps": steps, "warmup": warmup, "results": results,
        "table": table,
        "summary": summary, "notes": notes, "elapsed_s": elapsed,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if not dry else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
