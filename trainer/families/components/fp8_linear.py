"""fp8 compute for the frozen Linear layers of a LoRA run (`model.fp8_compute`): the weight is stored in float8
e4m3 with one scale per output row, each input is quantized to e4m3 per row (per token) as it arrives, and the
matmul runs on the GPU's fp8 tensor cores through `torch._scaled_mm` (compute capability 8.9+; torch also has a
CPU implementation, which the tests use). The backward gives the gradient of the input only (the LoRA layers
upstream need it), itself an fp8 matmul; the frozen weight gets none and nothing else is kept for it.

Not torchao's `Float8Linear`: it is made for trained weights, keeps them in high precision and quantizes them
again at every forward; a frozen weight is quantized once here and only its 8 bits are kept.

Every scale is a power of two (torchao's rowwise recipe does the same), so scaling is exact in any float dtype
and the only rounding is the cast to e4m3 (and the bf16 output of the rowwise kernel). `Fp8Linear` subclasses
nn.Linear, so peft's LoRA, LoKr and LoHa wrap it as their `base_layer` like any Linear."""

from __future__ import annotations

import re

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
ALIGN = 16  # _scaled_mm needs both dims of the weight to be multiples of 16 (CUDA's fp8 kernels)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, float32 scale per row, shape (rows, 1)) with x ~= q * scale, for a 2-D x. The scale is
    the power of two at or above the row's absolute maximum / 448: the largest value lands in e4m3's top
    binade, none overflows. An all-zero row gets scale 1."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    # Multiplying by a power of two is exact, in bf16 as in fp32; fp16 would overflow on tiny rows (2^24+).
    work = x.float() if x.dtype == torch.float16 else x
    q = (work * (1.0 / scale).to(work.dtype)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale


def _scaled_mm(a_q, a_scale, b_q_colmajor, b_scale, bias=None) -> torch.Tensor:
    # Row-wise scales: torch's CUDA kernels for those (CUTLASS on 8.9-10.x, cuBLAS 12.9+ on 9.0+) write bf16, so
    # the output is bf16 on every device (the CPU's too, for the same numbers) and the caller casts to its dtype.
    return torch._scaled_mm(a_q, b_q_colmajor, scale_a=a_scale, scale_b=b_scale, bias=bias,
                            out_dtype=torch.bfloat16)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_scale, bias, out_dtype):
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features)
        x_q, x_scale = quantize_rows(x2)
        b = None if bias is None else bias.to(torch.bfloat16)
        out = _scaled_mm(x_q, x_scale, weight.t(), weight_scale.view(1, -1), b)
        ctx.save_for_backward(weight, weight_scale)  # the stored weight: no activation is kept
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out.to(out_dtype).reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight, weight_scale = ctx.saved_tensors
        out_features, in_features = weight.shape
        g = grad_out.reshape(-1, out_features)
        # grad_x = grad_out @ (W_q * s_row): the weight's row scales lie along the contracted dimension here, so
        # they go into grad_out's columns (exact: powers of two) before it is quantized row by row.
        work = torch.float32 if g.dtype == torch.float16 else g.dtype  # fp16 would underflow, as in quantize_rows
        g = g.to(work) * weight_scale.view(1, -1).to(work)
        g_q, g_scale = quantize_rows(g)
        ones = torch.ones(1, in_features, device=weight.device, dtype=torch.float32)
        # _scaled_mm takes its second operand column-major: a transposed copy of the 8-bit weight, for this call.
        grad_x = _scaled_mm(g_q, g_scale, weight.t().contiguous().t(), ones)
        return grad_x.to(ctx.x_dtype).reshape(ctx.x_shape), None, None, None, None


class Fp8Linear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is stored in e4m3 (`weight`, shape (out, in)) with a power-of-two scale
    per output row (`weight_scale`, float32) and whose forward is an fp8 matmul. Its output has its input's
    dtype (under autocast, autocast's). `compute_dtype` is the dtype peft gives the adapters it adds on top
    (not float8).

    Both are buffers, not parameters: diffusers' `model.dtype` (which its pipelines cast inputs to) is the dtype
    of the first floating parameter, and FLUX's first is a Linear weight; DDP is told to leave float8 buffers
    alone (trainer.engine.parallel.ddp)."""

    weight_scale: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype):
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        q, scale = quantize_rows(weight.float() if weight.dtype == torch.float16 else weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale.view(-1))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast a Linear answers in the autocast dtype, whatever its input's; so does this one.
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return _Fp8Matmul.apply(x, self.weight, self.weight_scale, self.bias, out_dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in float32 (for tests and inspection)."""
        return self.weight.float() * self.weight_scale.view(-1, 1)


def require_fp8_matmul(device: torch.device) -> None:
    """Run one small row-wise fp8 matmul on `device`, or raise a UserError naming the key: compute capability
    8.9+ is what the plan checks, but a torch build may still lack the kernel for a GPU (torch's CUTLASS kernels
    cover 8.9, 9.x and 10.x; 12.x, RTX 50xx, needs cuBLAS 12.9+)."""
    from trainer.errors import UserError

    a = torch.ones(16, 16, device=device).to(FP8)
    ones = torch.ones(16, 1, device=device)
    try:
        _scaled_mm(a, ones, a.t(), ones.view(1, 16))
    except RuntimeError as err:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise UserError(f"model.fp8_compute: this torch build has no row-wise fp8 matmul for {name} ("
                        f"{str(err).splitlines()[0]}); set model.fp8_compute=off to keep the fp8 base weights as "
                        "storage only, or install a torch built for this GPU (CUDA 12.9 or newer).") from None


def fits(linear: torch.nn.Linear) -> bool:
    """Whether `linear` can take the fp8 matmul: frozen, floating, both dims multiples of 16."""
    w = linear.weight
    return (type(linear) is torch.nn.Linear and not w.requires_grad and w.is_floating_point()
            and w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0
            and (linear.bias is None or not linear.bias.requires_grad))


def _skipped(name: str, patterns) -> bool:
    """diffusers' layerwise-casting rule: a module is skipped when its dotted path, or any ancestor's, matches."""
    parts = name.split(".")
    return any(re.search(p, ".".join(parts[:i])) for i in range(1, len(parts) + 1) for p in patterns)


def swap_in_fp8_linears(module: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device,
                        skip_patterns=()) -> list[str]:
    """Replace every Linear of `module` that `fits` and whose path matches none of `skip_patterns` (the model's
    norms and embeddings, as diffusers keeps them) by an Fp8Linear on `device`, quantized there one layer at a
    time (the device never holds the network in full precision); returns their paths. The others are left as
    they are (the caller stores them as it would without fp8 compute)."""
    swapped = []
    for name, layer in list(module.named_modules()):
        if not isinstance(layer, torch.nn.Linear) or not fits(layer) or _skipped(name, skip_patterns):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, Fp8Linear(layer.to(device), compute_dtype))
        swapped.append(name)
    return swapped
