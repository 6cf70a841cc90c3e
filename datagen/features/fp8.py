"""speculators' FP8 hidden states (speculators#1028), in numpy: one float32 scale per token.

For a ``[T, L, H]`` tensor each token's scale covers all its layers and hidden dims::

    amax  = max |x[t]|                        (float32)
    scale = max(amax / 448, 1e-12)            (float32; 448 is float8_e4m3fn's largest value)
    q[t]  = float8_e4m3fn(x[t] / scale)       (round to nearest even)

which is what speculators' ``fp8_utils`` computes in torch, operation for operation in float32, so
the bytes should agree (not run against torch here: it is not installed). ``|x / scale| <= 448``
up to one rounding of the division, which the conversion rounds back to 448: nothing saturates.
e4m3fn has no infinity; its NaN is 0x7F / 0xFF. The last step is :func:`e4m3_bytes`, whole-array
integer passes that give ml_dtypes' bytes at twice the speed of its cast, which dominated the
FP8 path.

Also the bit-level view of the 16-bit source dtypes the checks use: a bf16 is the top half of a
float32, so widening is a shift; a value is non-finite when its exponent bits are all ones, which
for sign-stripped bits is ``bits >= exponent mask``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = [
    "BF16_EXPONENT_MASK",
    "E4M3_MAGNITUDE_MASK",
    "E4M3_NAN_MAGNITUDE",
    "F16_EXPONENT_MASK",
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "MAGNITUDE_MASK_16",
    "amax_from_bits",
    "bf16_bits_to_f32",
    "dequantize",
    "e4m3_bytes",
    "quantize",
    "quantize_scaled",
    "scales_from_amax",
]

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)
# speculators clamps a scale from below so an all-zero token divides by something.
FP8_MIN_SCALE = np.float32(1e-12)
# The sign bit cleared, a 16-bit float's bits order as its magnitude does (NaN above infinity).
MAGNITUDE_MASK_16 = 0x7FFF
BF16_EXPONENT_MASK = 0x7F80
F16_EXPONENT_MASK = 0x7C00
E4M3_MAGNITUDE_MASK = 0x7F
E4M3_NAN_MAGNITUDE = 0x7F
_BF16_SHIFT_BITS = 16
# The float32 -> e4m3fn rounding (e4m3_bytes).
_SIGN_BYTE_SHIFT = 24
_E4M3_SIGN = 0x80
_F32_MAGNITUDE_MASK = 0x7FFFFFFF
_F32_EXPONENT_MASK = 0x7F800000
_F32_MANTISSA_BITS = 23
_E4M3_MANTISSA_BITS = 3
_F32_BIAS = 127
_E4M3_MIN_EXPONENT = -6
_E4M3_MIN_EXPONENT_BITS = (_F32_BIAS + _E4M3_MIN_EXPONENT) << _F32_MANTISSA_BITS
# C = 2^(e + 20): its ulp is 2^(e - 3), e4m3's step at exponent e.
_ROUNDING_OFFSET_BITS = (_F32_MANTISSA_BITS - _E4M3_MANTISSA_BITS) << _F32_MANTISSA_BITS
# C's bits >> 20 are (e + 147) << 3; the code needs (e + 6) << 3: 141 << 3 less.
_EXPONENT_CODE_OFFSET = (
    _F32_BIAS + _F32_MANTISSA_BITS - _E4M3_MANTISSA_BITS + _E4M3_MIN_EXPONENT
) << _E4M3_MANTISSA_BITS

U16Array = npt.NDArray[np.uint16]
F32Array = npt.NDArray[np.float32]


def bf16_bits_to_f32(bits: U16Array, out: F32Array | None = None) -> F32Array:
    """bf16 bit patterns (uint16) as float32, exactly. ``out`` (float32, same shape) avoids an
    allocation."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    wide = out.view(np.uint32)
    np.copyto(wide, bits)
    np.left_shift(wide, _BF16_SHIFT_BITS, out=wide)
    return out


def amax_from_bits(magnitude_bits: U16Array, *, source_dtype: str) -> F32Array:
    """Per-token ``max |x|`` as float32 from ``[T, ...]`` sign-stripped 16-bit float bits."""
    rows = magnitude_bits.shape[0]
    top = magnitude_bits.reshape(rows, -1).max(axis=1) if rows else np.zeros(0, dtype=np.uint16)
    if source_dtype == "BF16":
        return bf16_bits_to_f32(top)
    if source_dtype == "F16":
        return top.view(np.float16).astype(np.float32)
    raise ValueError(f"no 16-bit float dtype {source_dtype!r}")


def scales_from_amax(amax: F32Array) -> F32Array:
    """``max(amax / 448, 1e-12)`` in float32: the per-token scales (flat, one per token)."""
    scales = np.divide(amax.astype(np.float32, copy=False), FP8_MAX)
    return np.maximum(scales, FP8_MIN_SCALE, out=scales)


def quantize(x: npt.NDArray[np.generic]) -> tuple[npt.NDArray[np.generic], F32Array]:
    """``x`` ``[T, L, H]`` (any float dtype numpy can widen to float32, bf16 included) as
    float8_e4m3fn plus its ``[T, 1, 1]`` float32 scales. ``x`` is left as it is; the streaming
    path (`datagen.features.capture_file`) uses the pieces below on its own scratch instead."""
    work = x.astype(np.float32)
    rows = work.shape[0]
    amax = np.abs(work).reshape(rows, -1).max(axis=1) if rows else np.zeros(0, dtype=np.float32)
    if not np.isfinite(amax).all():
        raise ValueError("non-finite values cannot be quantised")
    scales = scales_from_amax(amax).reshape(rows, 1, 1)
    return quantize_scaled(work, scales), scales


def quantize_scaled(
    work: F32Array,
    scales: F32Array,
    *,
    out: npt.NDArray[np.uint8] | None = None,
    scratch: npt.NDArray[np.uint32] | None = None,
) -> npt.NDArray[np.generic]:
    """``work / scales`` (one scale per first-axis index) as float8_e4m3fn. ``work`` (float32,
    finite) is overwritten; ``out`` (uint8) and ``scratch`` (uint32), of ``work``'s shape, avoid
    allocations. The result is ``out`` viewed as float8_e4m3fn."""
    np.divide(work, scales.reshape((-1,) + (1,) * (work.ndim - 1)), out=work)
    if out is None:
        out = np.empty(work.shape, dtype=np.uint8)
    if scratch is None:
        scratch = np.empty(work.shape, dtype=np.uint32)
    return e4m3_bytes(work, out=out, scratch=scratch).view(FP8_DTYPE)


def e4m3_bytes(
    work: F32Array, *, out: npt.NDArray[np.uint8], scratch: npt.NDArray[np.uint32]
) -> npt.NDArray[np.uint8]:
    """float32 values with ``|v| <= 464`` as float8_e4m3fn bytes, rounded to nearest even: what
    ml_dtypes' cast (and torch's) gives, in twelve whole-array integer and float passes, about
    twice as fast as that cast (bench/capture_path.py). ``work`` is overwritten. Larger values
    would need saturation or NaN; quantised values never exceed 448.

    Adding ``C = 2^(e + 20)`` to ``|v|`` (``e`` its exponent, at least -6, e4m3's smallest normal
    one) leaves 3 bits of ``|v|`` below its leading bit (or multiples of 2^-9 for subnormals)
    and lets the FPU round them to nearest even; the bits of the sum minus those of ``C`` are then
    ``8 + mantissa`` (``mantissa`` for subnormals), and ``(e + 6) << 3`` adds the exponent. No
    step makes a float32 subnormal, so flush-to-zero modes cannot change the result. Checked equal
    to ml_dtypes for every float32 of magnitude up to 464, both signs.
    """
    bits = work.view(np.uint32)
    np.right_shift(bits, _SIGN_BYTE_SHIFT, out=scratch)
    np.bitwise_and(scratch, _E4M3_SIGN, out=out, casting="unsafe")
    np.bitwise_and(bits, _F32_MAGNITUDE_MASK, out=bits)
    np.bitwise_and(bits, _F32_EXPONENT_MASK, out=scratch)
    np.maximum(scratch, _E4M3_MIN_EXPONENT_BITS, out=scratch)
    np.add(scratch, _ROUNDING_OFFSET_BITS, out=scratch)  # C
    np.add(work, scratch.view(np.float32), out=work)  # |v| + C: the rounding
    np.subtract(bits, scratch, out=bits)  # 8 + mantissa
    np.right_shift(scratch, _F32_MANTISSA_BITS - _E4M3_MANTISSA_BITS, out=scratch)
    np.add(bits, scratch, out=bits)
    np.subtract(bits, _EXPONENT_CODE_OFFSET, out=bits)
    np.bitwise_or(out, bits, out=out, casting="unsafe")
    return out


def dequantize(q: npt.NDArray[np.generic], scales: npt.NDArray[np.floating]) -> F32Array:
    """float8_e4m3fn ``[T, L, H]`` times its ``[T, 1, 1]`` scales, as float32.

    speculators multiplies in bf16 (``fp8.to(bf16) * scale.to(bf16)``); float32 keeps what the
    bytes hold and rounds once, if a caller wants bf16.
    """
    values = q.astype(np.float32)
    np.multiply(
        values, scales.astype(np.float32, copy=False).reshape((-1,) + (1,) * (q.ndim - 1)), out=values
    )
    return values
