"""The FP4 block formats' quantizer on the GPU (NVFP4, MXFP4), for the write kernels of
:mod:`foscar.triton.write`: :func:`foscar.fp4.quantize_blocks` in float64, bit for bit (the candidate block
scales, their bytes, the E2M1 rounding with ties to the even mantissa, the squared errors that choose).
"""
import triton
import triton.language as tl

from .tiles_fp4 import block_scales

@triton.jit
def _e2m1_round(y):
    """The E2M1 codes (int32) nearest ``y`` (float64), ties to the even mantissa, saturated at 6; a zero has
    its sign bit clear (:func:`foscar.fp4.e2m1_round`)."""
    a = tl.abs(y)
    k = ((a > 0.25).to(tl.int32) + ((a > 0.75) | (a == 0.75)).to(tl.int32) + (a > 1.25).to(tl.int32)
         + ((a > 1.75) | (a == 1.75)).to(tl.int32) + (a > 2.5).to(tl.int32) + ((a > 3.5) | (a == 3.5)).to(tl.int32)
         + (a > 5.0).to(tl.int32))  # a tie at midpoint i rounds up where i is odd: to the even code
    return k | (((y < 0) & (k > 0)).to(tl.int32) << 3)


@triton.jit
def _e2m1_value(code):
    """The magnitude of E2M1 ``code``'s value times its sign, float64."""
    k = code & 7
    v = tl.where(k < 4, k.to(tl.float64) * 0.5, tl.where(k < 6, (k - 2).to(tl.float64), tl.where(k == 6, 4.0, 6.0)))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e4m3_byte(s):
    """E4M3 byte (int32) of ``s`` (float64, 0 <= s): clamped to 448, rounded to FP32, then to E4M3 (nearest,
    ties to even), as ``s.clamp(max=448).to(float32).to(float8_e4m3fn)``."""
    f = tl.minimum(s, 448.0).to(tl.float32)
    bits = f.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = bits & 0x7FFFFF
    normal = ((e + 7) << 3) + ((m + 0x7FFFF + ((m >> 20) & 1)) >> 20)  # a mantissa carry bumps the exponent
    sub = ((f * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # below 2^-6: multiples of 2^-9, ties to even
    return tl.where(e < -6, sub, normal)


@triton.jit
def _e8m0_byte_up(r):
    """E8M0 byte (int32) of the least power of two at or above ``r`` (float64, > 0), its exponent clamped to
    [-127, 127] (``frexp`` as :func:`foscar.fp4._candidates` takes it)."""
    bits = r.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 2047) - 1023  # r normal in float64: r = 2^e (1 + f)
    up = e + ((bits & 0xFFFFFFFFFFFFF) != 0).to(tl.int64)
    return (tl.minimum(tl.maximum(up, -127), 127) + 127).to(tl.int32)


@triton.jit
def _e8m0_value(byte):
    """The float64 value ``2^(byte - 127)`` of an E8M0 byte (0 to 254)."""
    b = byte.to(tl.int64)
    # 2^(b - 127) as a float64: exponent field b - 127 + 1023 (b >= 0: always normal)
    return ((b + 896) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _block_error(xb, s):
    """Codes of blocks ``xb [R, NB, BLOCK]`` (float64) under scales ``s [R, NB]`` (0: codes 0) and the blocks'
    squared errors."""
    s3 = s[:, :, None]
    y = tl.where(s3 > 0, xb / tl.where(s3 > 0, s3, 1.0), 0.0)
    codes = _e2m1_round(y)
    d = _e2m1_value(codes) * s3 - xb
    return codes, tl.sum(d * d, axis=2)


@triton.jit
def quantize_blocks_fp4(src, tensor_scale, R: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                        E8M0: tl.constexpr, SEARCH: tl.constexpr):
    """``src [R, D]`` (float64, finite, within the blocks' limit: checked on the host) as FP4 blocks: the codes
    ``[R, D]`` and the scale bytes ``[R, D / BLOCK]`` (int32) :func:`foscar.fp4.quantize_blocks` gives, with
    NVFP4's ``tensor_scale`` (float64; 1 for MXFP4)."""
    NB: tl.constexpr = D // BLOCK
    xb = tl.reshape(src, (R, NB, BLOCK))
    amax = tl.max(tl.abs(xb), axis=2)  # [R, NB]
    if E8M0:
        up = _e8m0_byte_up(tl.maximum(amax / 6.0, 5.877471754111438e-39))  # 2^-127: frexp's clamp
        b1 = up
        b2 = tl.maximum(up - 1, 0)
        s1 = _e8m0_value(b1)
        s2 = _e8m0_value(b2)
    else:
        b1 = _e4m3_byte(amax / (6.0 * tensor_scale))
        b2 = _e4m3_byte(amax / (4.0 * tensor_scale))
        s1 = block_scales(b1, False).to(tl.float64) * tensor_scale  # exact: E4M3 values are FP32 values
        s2 = block_scales(b2, False).to(tl.float64) * tensor_scale
    # past the blocks' limit (or not finite): the NaN scale byte, never a clipped block (with check=False no
    # host check runs; with it, the host refuses such values first)
    limit = 6.0 * (1.7014118346046923e38 if E8M0 else 448.0 * tensor_scale)
    bad = (amax > limit) | (amax != amax)
    c1, e1 = _block_error(xb, s1)
    codes = c1
    byte = b1
    if SEARCH:  # the second candidate where its block error is smaller (ties: the first)
        c2, e2 = _block_error(xb, s2)
        better = e2 < e1
        codes = tl.where(better[:, :, None], c2, c1)
        byte = tl.where(better, b2, b1)
    return tl.reshape(codes, (R, D)), tl.where(bad, 255 if E8M0 else 0x7F, byte)
