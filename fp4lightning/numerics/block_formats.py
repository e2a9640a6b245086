"""Block-scaled FP4 formats: NVFP4 and MXFP4, with round-to-nearest or stochastic rounding.

The paper (arXiv 2501.17116, section 3.1) scales E2M1 per token / per output channel.
Later recipes scale small blocks along the GeMM's reduction dimension instead
(see ``docs/lightning.md``, "Block-scaled recipes"):

* **MXFP4** (OCP Microscaling Formats spec v1.0, section 6.3): blocks of 32 elements
  share one E8M0 scale (a bare power of two, stored as a biased 8-bit exponent, 255 =
  NaN). The shared exponent is ``floor(log2(amax)) - 2`` (2 = exponent of E2M1's largest
  power of two, 4), so ``amax / X`` lies in [4, 8) and the top of the block saturates at 6.
* **NVFP4** (NVIDIA, arXiv 2509.25149): blocks of 16 elements share an FP8 E4M3 scale,
  and a per-tensor fp32 scale ``amax / (448 * 6)`` keeps those E4M3 scales in range
  (two-level scaling). Weights may use 16 x 16 two-dimensional blocks, so that the
  same quantized weight serves the forward GeMM (blocks along K) and the dgrad GeMM
  (blocks along N).

The arithmetic follows torchao's ``prototype.mx_formats`` (``to_mx`` with the FLOOR
scale mode, ``nvfp4_quantize``) operation for operation, so codes and scales agree
bitwise with it in round-to-nearest mode (``tests/test_block_formats.py`` checks that
when torchao is installed, and checks OCP value tables always).

Codes are the E2M1 bit patterns of ``fp4lightning.numerics.formats`` packed two per byte
(element ``2j`` in the low nibble). A last dimension that is not a multiple of the
block is zero-padded inside the quantizer; ``dequantize`` trims it again.

Stochastic rounding (``rounding="stochastic"``) rounds each scaled value to one of its
two E2M1 neighbours with probability proportional to proximity, so that its expectation
is the value itself (unbiased). The uniform draws come from an explicit
``torch.Generator`` so runs are reproducible. Saturation at 6 is the only bias: MXFP4's
floor scale can put a block's amax at up to 8, so with stochastic rounding MXFP4 first
multiplies the block by 3/4 (Tseng et al. 2025, "Training LLMs with MXFP4") and
records ``post_scale = 4/3`` to undo it; NVFP4's scaled values exceed 6 only by the E4M3
rounding of the block scale (at most 1/16 relative), which is clamped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4lightning.numerics import cpu_bf16
from fp4lightning.numerics.constants import (E2M1_MAX, E2M1_MAX_POW2, E2M1_VALUES, E8M0_BIAS, E8M0_NAN, F8E4M3_MAX,
                                             F8E4M3_MIN_NORMAL, F32_MIN_NORMAL)
from fp4lightning.numerics.cpu_fused import fused_pass
from fp4lightning.numerics.formats import decode_packed_fp4, e2m1_index, pack_fp4

__all__ = [
    "BLOCK_FORMATS",
    "BLOCK_SIZES",
    "BlockFP4",
    "quantize_block",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "dequantize_block",
    "stochastic_round_e2m1",
    "sr_seed",
    "sr_seed_from_checksum",
    "hash_uniform",
    "e8m0_to_float",
    "block_gemm_reference",
    "fake_quantize_block",
]

BLOCK_FORMATS = ("nvfp4", "mxfp4")
BLOCK_SIZES = {"nvfp4": 16, "mxfp4": 32}
ROUNDINGS = ("nearest", "stochastic")

NVFP4_GLOBAL_DENOM = F8E4M3_MAX * E2M1_MAX  # 448 * 6: tensor amax -> per-tensor scale
MXFP4_SR_PRESCALE = 0.75  # Tseng et al. 2025: keeps amax/X < 8 inside [-6, 6] before SR


@dataclass
class BlockFP4:
    """A block-scaled FP4 tensor (2-D, row-major), as produced by ``quantize_block``.

    ``codes``: uint8 (M, Kp/2), two E2M1 codes per byte, ``Kp`` = K padded to the block.
    ``scales``: per block; NVFP4: ``float8_e4m3fn`` (M, Kp/16), or (Mp/16, Kp/16) with
    2-D blocks; MXFP4: uint8 biased E8M0 exponents (M, Kp/32).
    ``global_scale``: NVFP4's per-tensor fp32 decode scale (0-dim), else None.
    ``post_scale``: a constant factor of the whole tensor (4/3 after MXFP4's SR pre-scale).
    Decoded value: ``e2m1(code) * block_scale * global_scale * post_scale``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    fmt: str
    block_2d: bool
    shape: tuple[int, int]
    post_scale: float = 1.0

    @property
    def block(self) -> int:
        return BLOCK_SIZES[self.fmt]

    def block_scales_fp32(self) -> torch.Tensor:
        """fp32 decode scale of each block (NaN for an E8M0 NaN), without the global factor."""
        if self.fmt == "mxfp4":
            return e8m0_to_float(self.scales)
        return self.scales.float()

    def element_scales(self) -> torch.Tensor:
        """(M, Kp) fp32 block decode scale of every element (global and post scale excluded)."""
        s = self.block_scales_fp32()
        b = self.block
        m = self.shape[0]
        s = s.repeat_interleave(b, dim=1)
        if self.block_2d:
            s = s.repeat_interleave(b, dim=0)[:m]
        return s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_block(self, dtype)

    def nbytes(self) -> int:
        n = self.codes.numel() + self.scales.numel() * self.scales.element_size()
        return n + (4 if self.global_scale is not None else 0)

    def gemm_operand(self, dtype: torch.dtype) -> tuple[torch.Tensor, float | torch.Tensor]:
        """``(values, factor)``: the (M, K) values with their block scales, in ``dtype``, and the
        tensor-wide factor (global and post scale) a GeMM leaves for its epilogue.

        ``e2m1 * block_scale`` has at most 2 + 4 significant bits, so it is exact in bf16 and
        fp32 (barring E4M3/E8M0 exponents outside bf16's range, which they are not).
        """
        k = self.shape[1]
        vals = (_values(self.codes) * self.element_scales())[:, :k].to(dtype)
        g = self.post_scale
        if self.global_scale is not None:
            g = self.global_scale * g
        return vals, g


# --------------------------------------------------------------------------- rounding
_M32 = 0xFFFFFFFF
_M63 = (1 << 63) - 1
_SEED_SALT = 0x9E3779B1  # the golden-ratio constant sr_seed multiplies its draw by


def sr_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One draw from ``generator``: the 0-dim int64 seed of a stochastic-rounding stream."""
    dev = generator.device if generator is not None else device
    draw = torch.randint(0, 2**31, (), generator=generator, device=dev, dtype=torch.int64)
    return ((draw * _SEED_SALT) & _M32).to(device)


def sr_seed_from_checksum(base: int, checksum: torch.Tensor) -> torch.Tensor:
    """The 0-dim int64 seed of a stochastic-rounding stream, derived on the checksum's device.

    ``checksum``: the 0-dim int64 sum of an operand's raw bits (``fp4lightning.nn.block_linear``);
    ``base``: the config's and the operand's part of the seed. ``sr_seed`` draws from a
    ``torch.Generator``, whose ``manual_seed`` takes a host integer, so a checksum on a GPU would
    have to be copied to the host first (a sync in every backward). This derivation is integer
    arithmetic on the tensor instead: ``s = (base + checksum) mod 2^63`` (what seeded the
    generator), then ``lowbias32(lo32(s) ^ lowbias32(hi32(s) ^ 0x9E3779B1))``, in [0, 2^32) like
    ``sr_seed``'s draws. ``kernels/block_quantize.py`` computes the same bits inside its quantizer.
    """
    s = (checksum.to(torch.int64) + (int(base) & _M63)) & _M63
    return _lowbias32((s & _M32) ^ _lowbias32((s >> 32) ^ _SEED_SALT))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' ``lowbias32`` integer hash of int64 values in [0, 2^32) (int64 arithmetic, masked)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_uniform(n: int, seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``n`` fp32 uniforms in [0, 1) (24 random bits each): element ``i`` is a hash of ``i``
    and ``seed`` (Wellons' ``lowbias32`` integer hash). Counter-based: no generator state,
    so the draws fuse into the quantizer's pass and cost a few integer operations each,
    where ``torch.rand`` with a CPU generator costs ~9 ns per element; the same seed gives
    the same draws on every run and device."""
    x = _lowbias32((torch.arange(n, device=device, dtype=torch.int64) ^ seed) & _M32)
    return (x >> 8).to(torch.float32) * (2.0**-24)


def _round_values(y: torch.Tensor, rounding: str, generator: torch.Generator | None,
                  u: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``y`` in [-6, 6] rounded onto the E2M1 grid (values, sign kept; NaN stays NaN).

    The grid has spacing 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], so rounding is
    ``round(y / step) * step``. ``torch.round`` breaks ties to the even integer, which is
    exactly the even-mantissa E2M1 neighbour (0.25 -> 0, 2.5 -> 2, 5 -> 4). Stochastic:
    ``floor(|y| / step) + (u < frac)``, so ``E[q] = y`` and q is one of y's two neighbours.
    The uniforms are ``hash_uniform`` of a seed drawn from ``generator`` (``sr_seed``), over the
    elements in ``y``'s row-major order. ``u`` replaces them: fp32 uniforms with as many elements
    as ``y``, or a 0-dim int64 seed from ``sr_seed``.
    """
    a = y.abs()
    # step 0.5, 1 or 2 by comparisons (compiled, a bit reinterpretation would be a scalar loop)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    if rounding == "nearest":
        return torch.round(y / step).mul_(step)
    if rounding == "stochastic":
        t = a / step
        lo = torch.floor(t)
        if u is None:
            u = sr_seed(generator, y.device)
        if not u.is_floating_point():  # a seed
            u = hash_uniform(y.numel(), u, y.device)
        u = u.reshape(y.shape)
        q = lo.add_((u < t.sub_(lo)).float()).mul_(step)
        return torch.copysign(q, y)
    raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")


def _codes_of(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) of values already on the E2M1 grid; NaN -> code 0."""
    idx = e2m1_index(torch.nan_to_num(v.abs(), nan=0.0)).to(torch.uint8)
    return idx | (torch.signbit(v).view(torch.uint8) << 3)


def stochastic_round_e2m1(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastically round ``x`` (already scaled into E2M1 range) to E2M1 values (fp32).

    Unbiased inside [-6, 6]; beyond it values saturate to +/-6. Reproducible given
    ``generator``'s state.
    """
    return _round_values(x.float().clamp(-E2M1_MAX, E2M1_MAX), "stochastic", generator)


def _encode(y: torch.Tensor, rounding: str, generator: torch.Generator | None,
            seed: torch.Tensor | None = None) -> torch.Tensor:
    return _codes_of(_round_values(y, rounding, generator, seed))


def _values(packed: torch.Tensor) -> torch.Tensor:
    """fp32 E2M1 values of packed codes (M, Kp/2) -> (M, Kp)."""
    return decode_packed_fp4(packed, 2 * packed.shape[-1], torch.float32)


def _pad_to(x: torch.Tensor, dim: int, mult: int) -> torch.Tensor:
    r = (-x.shape[dim]) % mult
    if r == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, r]
    return torch.nn.functional.pad(x, pad)


def _check_2d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (rows x K), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    return x


# --------------------------------------------------------------------------- MXFP4
def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """fp32 value of biased E8M0 exponents (uint8): ``2**(e - 127)``, 255 -> NaN.

    Exponent 0 (2**-127, an fp32 subnormal) decodes to 2**-126 as in torchao (an all-zero
    block's scale; its codes are all 0, so the value does not matter).
    """
    b = biased.view(torch.uint8)
    s = torch.bitwise_left_shift(b.to(torch.int32), 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    return torch.where(b == E8M0_NAN, torch.full_like(s, float("nan")), s)


def _blocked(x: torch.Tensor, b: int, block_2d: bool) -> torch.Tensor:
    """``x`` (M, K) zero-padded and viewed as blocks: (M, Kp/b, b), or (Mp/16, 16, Kp/16, 16)."""
    xp = _pad_to(x, 1, b)
    if block_2d:
        xp = _pad_to(xp, 0, b)
    mp, kp = xp.shape
    xp = xp.contiguous()
    return xp.reshape(mp // b, b, kp // b, b) if block_2d else xp.reshape(mp, kp // b, b)


def _mx_prepare(x: torch.Tensor, rounding: str):
    """Scaled blocks ``(M, Kp/32, 32)`` clamped to [-6, 6], biased E8M0 exponents, fp32 block scales, post scale."""
    return _mx_prepare_blocked(_blocked(x, BLOCK_SIZES["mxfp4"], False), rounding)


def _mx_prepare_blocked(xb: torch.Tensor, rounding: str):
    """``_mx_prepare`` of blocks already laid out as (M, Kp/32, 32)."""
    xb = xb.float()
    amax = xb.abs().amax(-1, keepdim=True)
    # floor(log2(amax)) read off the fp32 exponent bits (exact; a subnormal amax gives -127)
    e = (torch.bitwise_right_shift(amax.view(torch.int32), 23) & 0xFF) - E8M0_BIAS
    e = (e - E2M1_MAX_POW2).clamp_(-E8M0_BIAS, E8M0_BIAS + 1)
    biased = (e + E8M0_BIAS).to(torch.uint8)
    biased = torch.where(torch.isnan(amax), torch.full_like(biased, E8M0_NAN), biased)
    scale = torch.bitwise_left_shift(biased.to(torch.int32), 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    y = xb / scale
    post = 1.0
    if rounding == "stochastic":
        y.mul_(MXFP4_SR_PRESCALE)
        post = 1.0 / MXFP4_SR_PRESCALE
    return y.clamp_(-E2M1_MAX, E2M1_MAX), biased.squeeze(-1), scale, post


def quantize_mxfp4(x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None,
                   *, seed: torch.Tensor | None = None) -> BlockFP4:
    """OCP MXFP4: 32-element blocks along the last dim, E8M0 scale ``2**(floor(log2 amax) - 2)``.

    ``seed`` (stochastic rounding): a 0-dim int64 seed (``sr_seed``, ``sr_seed_from_checksum``)
    used instead of a draw from ``generator``."""
    x = _check_2d(x, "quantize_mxfp4")
    m, k = x.shape
    y, biased, _, post = _mx_prepare(x, rounding)
    codes = _encode(y, rounding, generator, seed).reshape(m, -1)
    return BlockFP4(pack_fp4(codes), biased, None, "mxfp4", False, (m, k), post)


# --------------------------------------------------------------------------- NVFP4
def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp32 decode scale ``amax / (448 * 6)`` (1.0 for an all-zero tensor)."""
    amax = amax.float()
    # tensor / tensor, not tensor / Python scalar: on CUDA torch turns a scalar divisor into a
    # multiplication by its reciprocal, which is 1 ulp off the CPU's (and torchao's) IEEE division
    g = amax / torch.full_like(amax, NVFP4_GLOBAL_DENOM)
    return torch.where(g > 0, g, torch.ones_like(g))


def _nv_prepare(x: torch.Tensor, block_2d: bool, global_scale):
    """Scaled blocks clamped to [-6, 6], E4M3 block scales, the global scale.

    The scaled tensor is ``(M, Kp/16, 16)``, or ``(Mp/16, 16, Kp/16, 16)`` with 2-D tiles.
    """
    return _nv_prepare_blocked(_blocked(x, BLOCK_SIZES["nvfp4"], block_2d), block_2d, global_scale)


def _nv_prepare_blocked(xb: torch.Tensor, block_2d: bool, global_scale):
    """``_nv_prepare`` of blocks already laid out as (M, Kp/16, 16) or (Mp/16, 16, Kp/16, 16)."""
    xb = xb.float()
    if global_scale is True:
        global_scale = nvfp4_global_scale(xb.abs().amax())
    elif global_scale is False:
        global_scale = None
    bmax = xb.abs().amax(dim=(1, 3)) if block_2d else xb.abs().amax(-1)  # (Mp/16 or M, Kp/16)
    block_scale = bmax / E2M1_MAX
    if global_scale is None:
        s8 = block_scale.clamp(min=F8E4M3_MIN_NORMAL, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
        recip = 1.0 / s8.float()
    else:
        global_scale = global_scale.float().reshape(())
        s8 = (block_scale / global_scale).clamp(min=F8E4M3_MIN_NORMAL, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
        recip = (1.0 / global_scale) / s8.float()
    y = xb * (recip[:, None, :, None] if block_2d else recip.unsqueeze(-1))
    # NaN input: the block scale is NaN (E4M3 NaN), so the block decodes to NaN
    return y.clamp_(-E2M1_MAX, E2M1_MAX), s8, global_scale


def quantize_nvfp4(x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None,
                   block_2d: bool = False, global_scale: torch.Tensor | bool | None = True,
                   seed: torch.Tensor | None = None) -> BlockFP4:
    """NVFP4: 16-element blocks (or 16 x 16 with ``block_2d``), E4M3 block scales.

    ``global_scale``: True (default) computes the per-tensor fp32 scale from this tensor's
    amax; a tensor uses that scale; None/False means single-level scaling (E4M3 scales
    of ``amax_block / 6`` directly, torchao's ``per_tensor_scale=None``). ``seed``: as in
    ``quantize_mxfp4``.
    """
    x = _check_2d(x, "quantize_nvfp4")
    m, k = x.shape
    y, s8, g = _nv_prepare(x, block_2d, global_scale)
    codes = _encode(y, rounding, generator, seed).reshape(_rows(y, block_2d), -1)[:m]  # (M, Kp)
    return BlockFP4(pack_fp4(codes), s8, g, "nvfp4", block_2d, (m, k))


def _rows(y: torch.Tensor, block_2d: bool) -> int:
    return y.shape[0] * y.shape[1] if block_2d else y.shape[0]


def fake_quantize_block(x: torch.Tensor, fmt: str, rounding: str = "nearest",
                        generator: torch.Generator | None = None, block_2d: bool = False,
                        dtype: torch.dtype = torch.float32, seed: torch.Tensor | None = None):
    """``(values, factor, block_scales)``: the same quantization as ``quantize_block``, decoded.

    ``values`` (M, K) in ``dtype`` is ``e2m1 * block_scale`` (exact in bf16 and fp32), and
    ``values * factor`` is ``quantize_block(...).dequantize()`` (``factor``: the global and
    post scale, a float or 0-dim tensor). ``block_scales`` is the fp32 decode scale per
    block, (M, Kp/b) or (Mp/16, Kp/16). No packing: this is what the reference GeMMs use.

    The elementwise work runs as one fused pass (``fp4lightning.numerics.cpu_fused``: ``torch.compile`` on
    CPU, bit for bit equal to eager); stochastic rounding takes one seed from ``generator`` and
    uses the same uniforms as ``quantize_block`` with the generator in the same state (or the
    given 0-dim int64 ``seed`` instead of that draw).
    """
    x = _check_2d(x, "fake_quantize_block")
    if fmt not in BLOCK_SIZES:
        raise ValueError(f"unknown block format {fmt!r}; choose one of {BLOCK_FORMATS}")
    if fmt == "mxfp4" and block_2d:
        raise ValueError("2-D weight blocks are defined for NVFP4 (16x16) only; set weight_block_2d=False "
                         "with block32_e8m0")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
    b = BLOCK_SIZES[fmt]
    m, k = x.shape
    # the blocked view is made here, outside the fused pass: inside it, symbolic block counts
    # hide the unit stride of the block's elements and the compiled loops turn scalar
    xb = _blocked(x.detach(), b, block_2d)  # detached: never differentiated (and no extra graphs)
    # stochastic rounding: one seed from the generator; the pass hashes it into its uniforms
    u = None
    if rounding == "stochastic":
        u = sr_seed(generator, x.device) if seed is None else seed
    vals, factor, dec = _fake_quantize_blocked(xb, fmt, rounding, u, block_2d, dtype)
    return vals.reshape(_rows(xb, block_2d), -1)[:m, :k], factor, dec


@fused_pass
def _fake_quantize_blocked(xb: torch.Tensor, fmt: str, rounding: str, u: torch.Tensor | None, block_2d: bool,
                           dtype: torch.dtype):
    """The body of :func:`fake_quantize_block` on the blocked input, one fused pass: values in the
    blocked layout, the tensor-wide factor, the block decode scales."""
    if fmt == "mxfp4":
        y, biased, _, factor = _mx_prepare_blocked(xb, rounding)
        dec = e8m0_to_float(biased)
        bshape = dec.unsqueeze(-1)
    else:
        y, s8, g = _nv_prepare_blocked(xb, block_2d, True)
        dec = s8.float()
        bshape = dec[:, None, :, None] if block_2d else dec.unsqueeze(-1)
        factor = g
    vals = _round_values(y, rounding, None, u)
    return vals.mul_(bshape).to(dtype), factor, dec


def quantize_block(x: torch.Tensor, fmt: str, rounding: str = "nearest", generator: torch.Generator | None = None,
                   block_2d: bool = False, seed: torch.Tensor | None = None) -> BlockFP4:
    """Quantize a 2-D tensor along its last dim in ``fmt`` (``nvfp4`` or ``mxfp4``); ``seed`` as in
    ``quantize_mxfp4``."""
    if fmt == "nvfp4":
        return quantize_nvfp4(x, rounding, generator, block_2d=block_2d, seed=seed)
    if fmt == "mxfp4":
        if block_2d:
            raise ValueError("2-D weight blocks are defined for NVFP4 (16x16) only; set weight_block_2d=False "
                             "with block32_e8m0")
        return quantize_mxfp4(x, rounding, generator, seed=seed)
    raise ValueError(f"unknown block format {fmt!r}; choose one of {BLOCK_FORMATS}")


def dequantize_block(q: BlockFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(M, K) values ``e2m1 * block_scale * global_scale * post_scale``."""
    m, k = q.shape
    vals = _values(q.codes)  # (M, Kp)
    s = q.element_scales()
    if q.global_scale is not None:
        s = s * q.global_scale  # scale first, then values: torchao's order (bit-identical output)
    out = vals * s
    if q.post_scale != 1.0:
        out = out * q.post_scale
    return out[:, :k].to(dtype)


def block_gemm_reference(a: BlockFP4, b: BlockFP4, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``A B^T`` of two block-FP4 tensors that share their (last, reduction) dimension.

    Reference path: dequantize each block with its scale (exact in the compute dtype),
    one dense matmul (bf16 when ``out_dtype`` is bf16, else fp32), and the per-tensor
    factors in the fp32 epilogue.
    """
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"block_gemm_reference: reduction dims differ ({a.shape[1]} vs {b.shape[1]})")
    cd = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    av, ga = a.gemm_operand(cd)
    bv, gb = b.gemm_operand(cd)
    y = cpu_bf16.mm(av, bv.t()).float()
    g = ga * gb
    if not (isinstance(g, float) and g == 1.0):
        y = y * g
    return y.to(out_dtype)


def grid_values() -> tuple[float, ...]:
    """The E2M1 magnitudes (re-exported for tests and docs)."""
    return E2M1_VALUES
