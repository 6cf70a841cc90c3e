"""speculators' FP8 (one float32 scale per token, e4m3fn values) and the bf16 bit view, against
values worked out by hand and against ml_dtypes' own conversions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from datagen.features import fp8


def _bits_of(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize(
    ("bits", "value"),
    [
        (0x3FC0, 1.5),
        (0xBF80, -1.0),
        (0x4040, 3.0),
        (0x0000, 0.0),
        (0x7F80, np.inf),
        (0xFF80, -np.inf),
        (0x0001, 2.0**-133),  # the smallest subnormal: 2^-126 x 2^-7
    ],
)
def test_bf16_bits_widen_to_the_float32_they_stand_for(bits: int, value: float) -> None:
    assert fp8.bf16_bits_to_f32(np.array([bits], dtype=np.uint16))[0] == np.float32(value)


def test_every_bf16_bit_pattern_widens_like_ml_dtypes() -> None:
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    ours = fp8.bf16_bits_to_f32(bits)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # NaN payloads too
    out = np.empty(bits.shape, dtype=np.float32)
    assert fp8.bf16_bits_to_f32(bits, out=out) is out


def test_the_largest_e4m3fn_value_is_448_and_its_byte_is_0x7e() -> None:
    assert fp8.FP8_MAX == 448.0
    assert _bits_of([448.0, -448.0]).tolist() == [0x7E, 0xFE]
    assert float(np.uint8(0x7E).view(ml_dtypes.float8_e4m3fn)) == 448.0


def test_a_token_whose_scale_is_a_power_of_two_quantises_exactly() -> None:
    # amax 3.5: scale 3.5 / 448 = 2^-7 exactly, so x / scale = [128, -256, 64, 448]:
    # 2^7 is exponent 7 + bias 7 = 0b1110 -> 0x70; -2^8 -> sign, 0b1111 -> 0xF8; 2^6 -> 0x68.
    x = np.array([[[1.0, -2.0, 0.5, 3.5]]], dtype=np.float32)
    q, scales = fp8.quantize(x)
    assert scales.shape == (1, 1, 1)
    assert scales.dtype == np.float32
    assert scales[0, 0, 0] == np.float32(2.0**-7)
    assert q.dtype == ml_dtypes.float8_e4m3fn
    assert q.view(np.uint8).ravel().tolist() == [0x70, 0xF8, 0x68, 0x7E]
    assert np.array_equal(fp8.dequantize(q, scales), x)


def test_quantisation_rounds_to_nearest_even() -> None:
    # amax 7: scale 2^-6; x / scale = [448, 6.4, 6.25, -64, 0].
    # 6.4 = 1.6 x 2^2 lies between 1.5 (mantissa 100) and 1.625 (101): nearer 1.625 -> 0b0_1001_101.
    # 6.25 = 1.5625 x 2^2 is halfway between 100 and 101: to the even one, 100 -> 0b0_1001_100.
    x = np.array([[[7.0, 0.1, 0.09765625, -1.0, 0.0]]], dtype=np.float32)
    q, scales = fp8.quantize(x)
    assert scales[0, 0, 0] == np.float32(2.0**-6)
    assert q.view(np.uint8).ravel().tolist() == [0x7E, 0x4D, 0x4C, 0xE8, 0x00]


def test_each_token_has_its_own_scale_over_all_its_layers() -> None:
    x = np.zeros((3, 2, 4), dtype=np.float32)
    x[0, 1, 2] = -896.0  # amax 896 in layer 1: scale 2 for both layers of token 0
    x[0, 0, 0] = 2.0
    x[1, 0, 3] = 0.4375  # scale 2^-10
    _, scales = fp8.quantize(x)
    assert scales.ravel().tolist() == [2.0, 2.0**-10, np.float32(1e-12)]  # token 2: all zeros


def test_streaming_pieces_give_the_same_bytes_as_quantize() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 3, 64)) * rng.uniform(0.01, 100, (5, 1, 1))).astype(np.float32)
    q, scales = fp8.quantize(x)
    bits = x.view(np.uint32)
    magnitude = (bits >> 16).astype(np.uint16)  # bf16 truncation: amax through the bit path
    amax = fp8.amax_from_bits(magnitude & np.uint16(fp8.MAGNITUDE_MASK_16), source_dtype="BF16")
    assert np.array_equal(amax, np.abs(fp8.bf16_bits_to_f32(magnitude)).reshape(5, -1).max(axis=1))
    out = np.empty(x.shape, dtype=np.uint8)
    scratch = np.empty(x.shape, dtype=np.uint32)
    streamed = fp8.quantize_scaled(x.copy(), scales, out=out, scratch=scratch)
    assert streamed.dtype == ml_dtypes.float8_e4m3fn
    assert np.shares_memory(streamed, out)
    assert np.array_equal(out, q.view(np.uint8))


def test_our_e4m3_rounding_is_ml_dtypes_cast_on_a_dense_grid() -> None:
    # Every float32 up to 464 by its top 20 bits (sign, exponent, 11 mantissa bits: the kept
    # bits, the rounding bit and more), each with low bits that make ties, near-ties and sticky
    # bits; both signs. (The whole range, 2 x 1.1e9 values, was checked once the same way.)
    top = np.arange((int(np.float32(464.0).view(np.uint32)) >> 12) + 1, dtype=np.uint32) << 12
    bits = (top[:, None] | np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], dtype=np.uint32)).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    values = bits.view(np.float32)
    expected = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    out = np.empty(values.shape, dtype=np.uint8)
    got = fp8.e4m3_bytes(values.copy(), out=out, scratch=np.empty(values.shape, dtype=np.uint32))
    assert np.array_equal(got, expected)


def test_non_finite_values_cannot_be_quantised() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        fp8.quantize(np.array([[[1.0, np.nan]]], dtype=np.float32))


def test_f16_amax_from_bits() -> None:
    x = np.array([[1.5, -65504.0], [0.25, -0.5]], dtype=np.float16)
    amax = fp8.amax_from_bits(x.view(np.uint16) & np.uint16(fp8.MAGNITUDE_MASK_16), source_dtype="F16")
    assert amax.tolist() == [65504.0, 0.5]


def test_dequantised_values_are_within_e4m3_precision() -> None:
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 4, 256)) * 3).astype(np.float32)
    q, scales = fp8.quantize(x)
    back = fp8.dequantize(q, scales)
    assert back.dtype == np.float32
    # Three mantissa bits: half a step is 1/16 of the value for normals; below that the step is
    # the subnormal one, 2^-9 x scale.
    assert np.all(np.abs(back - x) <= np.abs(x) / 16 + scales * 2.0**-10 * 1.0001)
    assert np.abs(x).reshape(16, -1).max(axis=1).tolist() == pytest.approx(
        np.abs(back).reshape(16, -1).max(axis=1).tolist(), rel=1e-6
    )
