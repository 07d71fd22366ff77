"""E4M3 operands for the Hopper FP8 wgmma (``m64nNk32``): built from the packed words, and the arithmetic
of a decode that feeds them to the tensor cores.

**Construction by bit placement.** A byte holding a code ``q`` in its low bits *is* the E4M3 value
``q * 2^-9`` (INT2 codes and INT4 codes below 8 are subnormal; exact). From a packed word ``w`` of the
cache (``docs/layout.md``), E4M3 register ``i`` is ``(w >> bits*i) & 0x0F0F0F0F`` (INT4, ``i`` in 0..1)
or ``& 0x03030303`` (INT2, ``i`` in 0..3): byte ``b`` of register ``i`` (little-endian, bits ``8b..8b+7``)
holds the code at bit ``8b + bits*i`` of the word (:func:`e4m3_registers`). Those are the word's
BF16-fragment registers ``r = (16/bits)*(word's index among the thread's words) + 8*(b%2)/bits + i``,
half ``b // 2`` (:func:`byte_map` gives the token and channel of every byte of a pack block).

**Register order assumed for the kernel.** A thread's E4M3 registers are its words in order, each word's
``8/bits`` registers by increasing shift: register ``e = (8/bits)*(word index) + i`` (K: the thread's
words of its warp's K block; V: per m64 half, the thread's word of each V block of the tile in token
order). The wgmma ``m64nNk32`` A fragment for 8-bit types (CUTLASS ``GMMA::ALayout_64x32``) reads thread
``32w + l``, register ``4kb + j``, byte ``v`` as row ``16w + l//4 + 8(j%2)`` and contraction index
``kappa = 32kb + 4(l%4) + 16(j//2) + v``. With that order the rows are right as they stand (K: the
token, V: the channel of the m64 half) and the contraction index holds, in each block of 32,

- INT4: ``kappa = 16h + 4a + v``  ->  index ``16h + 8(v%2) + 2a + v//2``
- INT2: ``kappa = 16h + 4a + v``  ->  index ``16(v%2) + 8h + 2a + v//2``

(K: the channel, V: the token of the tile; :func:`contraction_order`). The kernel stores the B operand
in that order: its contraction index ``kappa`` holds channel ``order[kappa]`` of ``Q`` (or ``Q' = Q s'``),
``Q[:, order]``, and token ``order[kappa]`` of the tile's ``P`` (or ``P'``), ``P[:, order]``. The
permutation stays inside each block of 32, so channel groups and token groups (``g >= 32``) keep their
members, and it is the same for K and V tiles of one bit width.

**The other operand: residual terms.** One E4M3 term (3 mantissa bits) is several percent of output
error (2-6% on the inputs of ``tests/test_e4m3.py``).
:func:`split_terms` writes ``x`` as ``terms`` E4M3 values, ``hi = e4m3(x 2^e)``, then each residual
scaled up 16x, ``e4m3(r 16^k) / 16^k``, with one power-of-two scale ``2^e`` per slice (the largest that
keeps the slice's maximum within 448). Each term rides in its own wgmma N columns; the products are
summed after the MMA in FP32 (:func:`term_product`).
"""
from __future__ import annotations

import functools

import torch

from ._checks import check_int
from .errors import InvalidArgumentError
from .format import SUPPORTED_BITS, SUPPORTED_HEAD_DIMS, block_tokens, words_per_block

#: The largest finite E4M3 (float8_e4m3fn) value.
E4M3_MAX = 448.0
#: The mask of :func:`e4m3_registers`: one ``bits``-wide field at the bottom of each byte.
PLACEMENT_MASK = {2: 0x03030303, 4: 0x0F0F0F0F}
#: Tokens of the KV tile a Hopper kernel reads (the fragment maps are per tile).
TILE_TOKENS = 64
#: Channel-wise K's ``Q' 2^e`` rounded to FP16 before its split into terms (:func:`split_terms`' ``fp16_first``): how
#: the CuTe kernels fold it (the split in FP16 pairs, :data:`foscar.cute.config.FOLD_F16_SPLIT`) and so how
#: :func:`foscar.decode_folded` emulates it
Q_PRIME_FP16_FIRST = True


def _check(bits: int, tensor: str | None = None, head_dim: int | None = None) -> None:
    check_int("bits", bits, allowed=SUPPORTED_BITS)
    if tensor is not None and tensor not in ("k", "v"):
        raise InvalidArgumentError("tensor", "'k' or 'v'", repr(tensor))
    if head_dim is not None:
        check_int("head_dim", head_dim, allowed=SUPPORTED_HEAD_DIMS)


def registers_per_word(bits: int) -> int:
    """E4M3 registers (4 bytes each) built from one packed word: 2 (INT4), 4 (INT2)."""
    return 8 // bits


# --------------------------------------------------------------------------------------------
# Construction from the packed words
# --------------------------------------------------------------------------------------------
def e4m3_registers(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The E4M3 operand bytes of packed words: int32 ``[..., W]`` -> uint8 ``[..., W, 8/bits, 4]``.

    ``[..., w, i, b]`` is byte ``b`` (bits ``8b..8b+7``) of register ``(words[w] >> bits*i) & mask``
    (:data:`PLACEMENT_MASK`), i.e. the code at bit ``8b + bits*i`` of the word; read as
    ``torch.float8_e4m3fn`` it is that code times ``2^-9``."""
    _check(bits)
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() < 1:
        raise InvalidArgumentError("words", "an int32 tensor [..., W]", f"{words.dtype} shape {tuple(words.shape)}"
                                   if isinstance(words, torch.Tensor) else type(words).__name__)
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = bits * torch.arange(registers_per_word(bits), device=words.device)
    regs = (w[..., None] >> shifts) & PLACEMENT_MASK[bits]
    return ((regs[..., None] >> (8 * torch.arange(4, device=words.device))) & 0xFF).to(torch.uint8)


@functools.cache
def byte_map(bits: int, head_dim: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token, channel)`` of every byte :func:`e4m3_registers` builds from one pack block, each of shape
    ``[words per block, 8/bits, 4]`` (word, register, byte), from the layout of ``docs/layout.md``:
    the code at bit ``p = 8b + bits*i`` is half ``p // 16`` of the word's BF16-fragment register
    ``p % 16 / bits``."""
    _check(bits, tensor, head_dim)
    D = head_dim
    i = torch.arange(registers_per_word(bits))[None, :, None]
    b = torch.arange(4)[None, None, :]
    r_in_word = 8 * (b % 2) // bits + i  # the BF16-fragment register, among the word's 16/bits
    half = b // 2
    if tensor == "k":  # 32 lanes x D*bits/64 words: lane l, its word wl
        lw = D * bits // 64
        w = torch.arange(32 * lw)[:, None, None]
        lane, r = w // lw, (16 // bits) * (w % lw) + r_in_word
        j = r % 4
        token = lane // 4 + 8 * (j % 2)
        channel = 16 * (r // 4) + 2 * (lane % 4) + 8 * (j // 2) + half
    else:  # 128 threads x D/64 words (one per m64 half of the channels)
        mh_n = D // 64
        w = torch.arange(128 * mh_n)[:, None, None]
        thread, mh, r = w // mh_n, w % mh_n, r_in_word
        lane, warp, j = thread % 32, thread // 32, r % 4
        channel = 64 * mh + 16 * warp + lane // 4 + 8 * (j % 2)
        token = 16 * (r // 4) + 2 * (lane % 4) + 8 * (j // 2) + half
    shape = (words_per_block(bits, D, tensor), registers_per_word(bits), 4)
    return token.expand(shape).contiguous(), channel.expand(shape).contiguous()


def _tile_blocks(bits: int, tensor: str) -> int:
    return TILE_TOKENS // block_tokens(bits, tensor)


def tile_registers(words: torch.Tensor, bits: int, tensor: str, head_dim: int) -> torch.Tensor:
    """The A fragment of one 64-token tile in the kernel's register order: int32 words ``[..., 64*D*bits/32]``
    (the tile's pack blocks in order) -> uint8 ``[..., M, 128, R, 4]`` (m64 block, thread, register,
    byte). K (``S^T = K Q^T``): ``M = 1``, ``R = D/8``; thread ``32w + l`` takes lane ``l`` of K block
    ``w``, register ``(8/bits)*wl + i`` from its word ``wl``. V (``O^T = V^T P^T``): ``M = D/64`` (the
    m64 halves of the channels), ``R = 8``; register ``(8/bits)*vb + i`` from the thread's word of V
    block ``vb``. :func:`tile_fragment_map` says what each byte holds."""
    _check(bits, tensor, head_dim)
    D = head_dim
    nb = _tile_blocks(bits, tensor)
    *lead, W = words.shape
    if W != nb * words_per_block(bits, D, tensor):
        raise InvalidArgumentError("words", f"the {nb * words_per_block(bits, D, tensor)} words of a 64-token tile", W)
    regs = e4m3_registers(words, bits)  # [..., W, 8/bits, 4]
    rpw = registers_per_word(bits)
    if tensor == "k":  # blocks = warps; each lane's words contiguous
        return regs.reshape(*lead, 1, 128, (D * bits // 64) * rpw, 4)
    regs = regs.reshape(*lead, nb, 128, D // 64, rpw, 4)
    n = len(lead)
    regs = regs.permute(*range(n), n + 2, n + 1, n, n + 3, n + 4)  # [..., mh, thread, block, i, byte]
    return regs.reshape(*lead, D // 64, 128, nb * rpw, 4)


@functools.cache
def tile_fragment_map(bits: int, head_dim: int, tensor: str) -> dict[str, torch.Tensor]:
    """For every byte of :func:`tile_registers` (shape ``[M, 128, R, 4]``): ``row`` and ``kappa``, where
    the ``m64nNk32`` A fragment puts it (row of the 64-row MMA plus ``64*M``, contraction index), and
    ``token`` and ``channel`` of the tile that it holds."""
    _check(bits, tensor, head_dim)
    D = head_dim
    m_n = 1 if tensor == "k" else D // 64
    regs = D // 8 if tensor == "k" else 8
    m, t, e, v = torch.meshgrid(torch.arange(m_n), torch.arange(128), torch.arange(regs), torch.arange(4),
                                indexing="ij")
    warp, lane, kb, j = t // 32, t % 32, e // 4, e % 4
    row = 64 * m + 16 * warp + lane // 4 + 8 * (j % 2)
    kappa = 32 * kb + 4 * (lane % 4) + 16 * (j // 2) + v
    btok, bch = byte_map(bits, D, tensor)
    rpw = registers_per_word(bits)
    if tensor == "k":
        lw = D * bits // 64
        idx = (lane * lw + e // rpw, e % rpw, v)
        token, channel = 16 * warp + btok[idx], bch[idx]
    else:
        blk = e // rpw
        idx = (t * (D // 64) + m, e % rpw, v)
        token, channel = blk * block_tokens(bits, "v") + btok[idx], bch[idx]
    return {"row": row, "kappa": kappa, "token": token, "channel": channel}


@functools.cache
def contraction_order(bits: int, n: int) -> torch.Tensor:
    """``order [n]`` (``n`` a multiple of 32): contraction index ``kappa`` of the E4M3 fragment holds
    channel (K) or token (V) ``order[kappa]``. The other operand is stored permuted the same way:
    ``Q[..., order]`` (K tiles), ``P[..., order]`` over a tile's tokens (V tiles)."""
    _check(bits)
    check_int("n", n, minimum=32, multiple_of=32)
    kappa = torch.arange(n)
    blk, h, a, v = kappa // 32, (kappa % 32) // 16, (kappa % 16) // 4, kappa % 4
    if bits == 4:
        local = 16 * h + 8 * (v % 2) + 2 * a + v // 2
    else:
        local = 16 * (v % 2) + 8 * h + 2 * a + v // 2
    return 32 * blk + local


# --------------------------------------------------------------------------------------------
# The arithmetic: rounding, residual terms, tile products
# --------------------------------------------------------------------------------------------
def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value, ties to even, saturating at +-448 (``cvt.rn.satfinite``), in
    float64 (one rounding from any float input; non-finite values stay as they are)."""
    x = x.double()
    a = x.abs().clamp(max=E4M3_MAX)
    _, ex = torch.frexp(a)  # a = m 2^ex, m in [0.5, 1): the E4M3 step is 2^(ex - 4), at least 2^-9
    step = torch.clamp(ex.to(torch.int64) - 4, min=-9)
    r = torch.ldexp(torch.round(torch.ldexp(a, -step)), step)  # torch.round: ties to even
    return torch.where(torch.isfinite(x), torch.copysign(r, x), x)


def scale_exponent(top: torch.Tensor) -> torch.Tensor:
    """The largest ``e`` with ``top * 2^e <= 448`` (int64; 0 where ``top`` is 0 or not finite)."""
    m, ex = torch.frexp(top.double())
    e = torch.where(m <= E4M3_MAX / 512, 9 - ex.to(torch.int64), 8 - ex.to(torch.int64))  # 448 = 0.875 * 2^9
    return torch.where((top > 0) & torch.isfinite(top), e, torch.zeros_like(e))


def split_terms(x: torch.Tensor, terms: int, dims: tuple[int, ...], in_place: bool = False,
                fp16_first: bool = False) -> list[torch.Tensor]:
    """``x`` as ``terms`` E4M3 terms (float64, each scaled back): scale ``2^e`` per slice over ``dims``
    (:func:`scale_exponent` of the slice's largest ``|x|``), ``r_0 = x 2^e``; term ``k`` is
    ``t_k = e4m3(r_k 16^k) / 16^k`` and ``r_{k+1} = r_k - t_k`` (exact). Returns ``t_k 2^-e``: the
    operand the tensor core consumes is their sum (exact in FP32), and each term's product is that of
    the E4M3 value ``e4m3(r_k 16^k)`` scaled by ``16^-k 2^-e`` after the MMA (a power of two: exact).
    ``in_place``: each term rounded where it sits, ``t_k = e4m3(r_k)``, for terms the tensor core sums itself
    (stacked along the contraction, :attr:`foscar.cute.config.Sm90Config.stacked_terms`): the same terms where
    each residual ``r_k`` is at least E4M3's smallest normal, ``2^-6``; below it a term keeps E4M3's subnormal
    steps, ``2^-9`` (a slice's largest ``|r_0|`` is above 224: ``2^-10`` is ``2^-17.8`` of it). ``fp16_first``:
    ``r_0`` rounded to FP16 before the terms (channel-wise K's fold split in FP16 pairs,
    :attr:`foscar.cute.config.Sm90Config.fold_f16_split`; each remainder is exact in FP16 there too)."""
    check_int("terms", terms, minimum=1)
    xd = x.double()
    e = scale_exponent(xd.abs().amax(dim=dims, keepdim=True))
    r = torch.ldexp(xd, e)
    if fp16_first:
        r = r.to(torch.float16).double()
    out = []
    for k in range(terms):
        t = round_e4m3(r) if in_place else round_e4m3(r * 16.0 ** k) * 16.0 ** -k
        r = r - t
        out.append(torch.ldexp(t, -e))
    return out


#: The largest ``|x 2^e|`` of a slice whose :func:`split_digits` terms are integer digits: ``2^e`` puts the slice's
#: largest ``|x|`` in ``(7, 14]``, so the first digit is at most 14 and every later one at most 8 in magnitude.
DIGIT_TOP = 14.0


def split_digits(x: torch.Tensor, terms: int, dims: tuple[int, ...]) -> list[torch.Tensor]:
    """``x`` as ``terms`` integer digits in base 16 (float64, each scaled back): scale ``2^e`` per slice over
    ``dims``, the largest with the slice's largest ``|x 2^e|`` at most :data:`DIGIT_TOP` (in ``(7, 14]``),
    ``r_0 = x 2^e``; digit ``k`` is ``d_k = round(r_k)`` (half away from zero) and ``r_{k+1} = 16 (r_k - d_k)``
    (exact). Returns ``d_k 16^-k 2^-e``. Every digit is an integer of magnitude at most 14 (the first) or 8, an
    exact E4M3 value, so every product with a code placed as ``q 2^-9`` is a multiple of ``2^-9`` and a k32 step's
    sum of them (at most ``32 x 12 x 14`` such units, INT2 with token half 1's ``4 q``) is exact in the FP8
    wgmma's accumulation, which keeps about 14 bits (:func:`split_terms`' residual terms are not: their products
    span many exponents, and the accumulation rounds the small ones toward zero). The digits hold ``x`` to
    ``2^-(4 terms - 1)`` of the slice's largest ``|x|`` (four digits: ``2^-15``)."""
    check_int("terms", terms, minimum=1)
    xd = x.double()
    top = xd.abs().amax(dim=dims, keepdim=True)
    e = scale_exponent(top) - 5  # top 2^e in (224, 448] -> (7, 14]
    r = torch.ldexp(xd, e)
    out = []
    for k in range(terms):
        d = torch.trunc(r + torch.copysign(torch.full_like(r, 0.5), r))
        out.append(torch.ldexp(d * 16.0 ** -k, -e))
        r = (r - d) * 16.0
    return out


#: Significant bits an FP8 wgmma keeps of its sums, in :func:`truncating_step_sum`'s model (about 14 on Hopper:
#: ``../shared/docs/cute-dsl-hopper.md``; ``benchmarks/e4m3_accumulation_bias.py`` measures its bias toward zero)
FP8_SUM_BITS = 14


def truncating_step_sum(products: torch.Tensor, acc: torch.Tensor, bits: int = FP8_SUM_BITS) -> torch.Tensor:
    """A model of one FP8 wgmma k-step's accumulation: ``acc + sum(products[..., :])`` (float64) with every addend
    first truncated toward zero to ``2^(E - bits + 1)``, ``E`` the exponent of the largest ``|addend|``, as a sum that
    aligns its addends to the largest and keeps ``bits`` bits. Exact where every addend is a multiple of that step
    (:func:`split_digits`' products); otherwise each addend loses its low bits (:func:`split_terms`' residual terms),
    the sum moving toward zero by what its own-signed addends lose."""
    check_int("bits", bits, minimum=1)
    if acc.shape != products.shape[:-1]:
        want = tuple(products.shape[:-1])
        raise InvalidArgumentError("acc", f"a tensor of products' shape less its last dim, {want}", tuple(acc.shape))
    addends = torch.cat([products.double(), acc.double()[..., None]], -1)
    top = addends.abs().amax(-1, keepdim=True)
    _, ex = torch.frexp(torch.where(top > 0, top, torch.ones_like(top)))  # top in [2^(ex - 1), 2^ex)
    step = torch.ldexp(torch.ones_like(top), ex.to(torch.int64) - bits)
    return (torch.trunc(addends / step) * step).sum(-1)


def term_product(equation: str, terms: list[torch.Tensor], y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_k einsum(equation, terms[k], y)``, as a tile's E4M3 MMA gives it with FP32 accumulation: the
    product of two E4M3 values has 8 significant bits and one term's values span at most 2^27 (448
    down to 2^-9), so float64 forms each term's tile sum exactly; it is rounded once to ``dtype``, then
    the terms are added in ``dtype``, largest first. This is the limit of an FP32 accumulator: a real
    FP8 wgmma keeps fewer bits inside its sums (``../shared/docs/cute-dsl-hopper.md``), so the kernel
    promotes each tile's sum to FP32; that internal rounding is not modelled here."""
    yd = y.double()
    out = None
    for t in terms:
        p = torch.einsum(equation, t, yd).to(dtype)
        out = p if out is None else out + p
    return out
