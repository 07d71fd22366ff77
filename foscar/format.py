"""The quantized KV format: one definition, read by every backend.

A stored value is ``x = s*q + z`` with ``q`` an unsigned ``bits``-bit code and ``(s, z)`` shared by
a group of ``group_size`` values: token-wise (a group spans ``g`` channels of one token) or
channel-wise (a group spans ``g`` tokens of one channel), chosen independently for K and V.

Tensor cores never see ``q`` itself. A bit trick builds an operand ``y = alpha*q + beta`` straight
from the packed word (an :class:`OperandMapping`), and the cache stores the *folded* constants of
paper eq. 5 instead of ``(s, z)``::

    s' = s / alpha,      z' = z - beta * s',      so that      x = s' * y + z'.

``(s', z')`` are FP32 and are the canonical stored parameters: the value a cache holds *is*
``s'*y + z'`` (evaluated exactly, e.g. in float64), and every backend reads the same numbers.

Codes are packed into 32-bit words in the layout ``LAYOUT_TAG`` (``docs/layout.md``), chosen so that
the Hopper kernel's wgmma register fragments are built with one shift and one masked merge per
register, and so that every other backend reads the very same words.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._checks import check_int
from .errors import InvalidArgumentError, UnsupportedError
from .rotation import ROTATIONS

TOKEN = "token"
CHANNEL = "channel"
AXES = (TOKEN, CHANNEL)

SUPPORTED_BITS = (2, 4)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_GROUPS = (32, 64, 128, 256)
AFFINE = "affine"
#: How a cache's values are coded (:attr:`KVFormat.scheme`): ``"affine"`` (``x = s q + z``, the paper's
#: formats) or the FP4 block formats of :mod:`foscar.fp4` (E2M1 codes, one scale per block of channels).
SCHEMES = (AFFINE, "nvfp4", "mxfp4")

#: Layout tag of the packed words (bumped whenever the bit layout changes).
LAYOUT_TAG = "foscar-wgmma-rs-v1"

#: Tokens per K pack block: one warp's 16 rows of the m64 wgmma A tile.
K_BLOCK_TOKENS = 16
#: Page sizes must be multiples of this (the smallest unit a tile is built from).
PAGE_QUANTUM = 16


def v_block_tokens(bits: int) -> int:
    """Tokens per V pack block: the k16 blocks one 32-bit word spans (16 for INT4, 32 for INT2)."""
    return 64 // bits


def block_tokens(bits: int, tensor: str) -> int:
    return K_BLOCK_TOKENS if tensor == "k" else v_block_tokens(bits)


# --------------------------------------------------------------------------------------------
# Operand mappings (paper Table 1, eq. 5)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OperandMapping:
    """How a tensor-core operand ``y = alpha*q + beta`` is built from a code ``q`` by bit placement."""

    name: str
    alpha: float
    beta: float
    operand: str  # the operand's number format
    how: str

    def fold(self, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Paper eq. 5 in FP32: ``s' = s/alpha``, ``z' = z - beta*s'``."""
        s = s.to(torch.float32)
        z = z.to(torch.float32)
        sp = s / self.alpha  # alpha is a power of two: exact
        zp = (z.double() - self.beta * sp.double()).to(torch.float32)  # one rounding
        return sp, zp

    def unfold(self, sp: torch.Tensor, zp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(s, z)`` that the stored ``(s', z')`` stand for, in float64 (exact)."""
        sp = sp.double()
        return sp * self.alpha, zp.double() + self.beta * sp

    def pivot(self, bits: int) -> float:
        """The operand value of the middle code, ``beta + alpha*(2^bits - 1)/2``.

        Operand-fold corrections are taken around it (``x = s'*(y - pivot) + (z' + pivot*s')``), so the
        tensor core's product sees ``y - pivot`` centred on zero and the rounding error of the scaled
        operand does not act on a one-signed ``q``: about 2x less error than around ``beta``.
        """
        return self.beta + self.alpha * ((1 << bits) - 1) / 2

    def construct(self, q: torch.Tensor) -> torch.Tensor:
        """Build the operand from codes by the bit trick alone; returns float64 values.

        ``q`` holds integer codes. The result is what the tensor core reads, decoded from the bit
        pattern (never computed as ``alpha*q + beta``): tests compare the two.
        """
        q = q.to(torch.int32)
        if self.operand in INJECTION_FORMATS:
            return self.inject_bits(q).view(INJECTION_FORMATS[self.operand][0]).double()
        if self.operand == "f16-placed":
            shl = int(self.name.split("<<")[1])
            return (q << shl).to(torch.int16).view(torch.float16).double()
        if self.name == "e4m3":
            return q.to(torch.uint8).view(torch.float8_e4m3fn).double()
        if self.name == "e2m1":
            return e2m1_decode(q)
        raise UnsupportedError("mapping", self.name)  # pragma: no cover

    def inject_bits(self, q: torch.Tensor) -> torch.Tensor:
        """Mantissa injection (``alpha = 1``, ``beta = 2^e``): the 16-bit pattern of ``beta`` with ``q``
        in the top mantissa bits it leaves integer-valued, i.e. ``exponent(beta) | (q << (M - e))``
        (``M`` = 7 for BF16, 10 for FP16). ``beta = 128`` in BF16 is the paper's ``0x4300 | q``."""
        dtype, mbits = INJECTION_FORMATS[self.operand]
        e = int(math.log2(self.beta))
        pattern = torch.tensor(self.beta, dtype=dtype).view(torch.int16).item() & 0xFFFF
        return ((q.to(torch.int32) << (mbits - e)) | pattern).to(torch.int16)


INJECTION_FORMATS = {"bf16": (torch.bfloat16, 7), "f16": (torch.float16, 10)}


@functools.lru_cache(maxsize=64)  # launchers ask for it on every call
def injection(operand: str, beta: int) -> OperandMapping:
    """Mantissa injection into ``operand`` ("bf16" or "f16") with offset ``beta`` (a power of two):
    ``y = q + beta`` for codes ``q < beta``."""
    pattern = torch.tensor(float(beta), dtype=INJECTION_FORMATS[operand][0]).view(torch.int16).item() & 0xFFFF
    return OperandMapping(f"{operand}" if beta == {"bf16": 128, "f16": 1024}[operand] else f"{operand}+{beta}",
                          1.0, float(beta), operand, f"0x{pattern:04X} | q << {INJECTION_FORMATS[operand][1] - int(math.log2(beta))}"
                          f"  ->  q + {beta}")


@functools.lru_cache(maxsize=16)
def f16_placement(shl: int) -> OperandMapping:
    """FP16 placement: a code at bit ``shl`` of an FP16 whose exponent field is 0 (``shl + bits <= 11``: subnormal,
    or the first normal binade, where the bit pattern's value is linear), ``y = q 2^(shl - 24)`` with no offset
    (``beta = 0``), built by a mask alone: a product over such operands carries no ``beta sum(P)`` to lose bits to."""
    return OperandMapping(f"f16<<{shl}", 2.0 ** (shl - 24), 0.0, "f16-placed", f"q << {shl}  ->  q 2^{shl - 24}")


#: The units ``sigma`` of the GPU kernels' operand-fold of token-wise V, ``P' = P s'_V / sigma`` (a power of two,
#: rescaled as it grows): from the smallest normal FP32, at least every ``|s'_V|`` and :data:`P_UNITS_OFFSET_RATIO`
#: times every ``|z'_V|`` seen: ``P'`` keeps its FP16 precision whatever the scales, and the offset corrections, in
#: units of sigma, stay within ``2^64`` of it (a tile of constant groups has all scales 0).
P_UNITS_START = 2.0 ** -126
P_UNITS_OFFSET_RATIO = 2.0 ** -64
#: The lazy rescale's headroom (base 2): maxima and ``sigma`` kept while no score passes them by more (``P <= 2^8``)
RESCALE_HEADROOM = 8.0


@functools.lru_cache(maxsize=256)  # host time per call: a launch's constants are its format's
def fold_constants(prefix: str, op: OperandMapping, fmt) -> dict:
    """The constants of a fold whose operands follow ``op`` over a cache stored for ``fmt``'s mapping:
    ``<prefix>_PIVOT`` (the operand of the middle code), ``<prefix>_FACTOR`` (``alpha_cache / alpha_op``, a
    power of two: the operand's scale is ``s' FACTOR``) and ``<prefix>_MID`` (the group's middle value is
    ``z' + MID s'``), as :func:`foscar.decode_folded` forms them."""
    pivot = op.pivot(fmt.bits)
    factor = fmt.op.alpha / op.alpha
    return {f"{prefix}_PIVOT": pivot, f"{prefix}_FACTOR": factor,
            f"{prefix}_MID": fmt.op.beta + (pivot - op.beta) * factor}


def injection_constants(prefix: str, op: OperandMapping, fmt) -> dict:
    """What a kernel needs to build one product's operands by mantissa injection: ``<prefix>_PATTERN`` (the
    16-bit pattern of ``beta``), ``<prefix>_SHL`` (the shift that puts a code in the top mantissa bits),
    ``<prefix>_PIVOT`` (the operand of the middle code) and ``<prefix>_MID``: the group's middle value is
    ``z' + MID s'`` from the cache's stored ``z'`` (made for ``fmt``'s mapping). One home for the Triton
    and CuTe kernels."""
    pattern = int(op.inject_bits(torch.zeros((), dtype=torch.int32))) & 0xFFFF
    shl = INJECTION_FORMATS[op.operand][1] - int(math.log2(op.beta))
    fold = fold_constants(prefix, op, fmt)
    if fold[f"{prefix}_FACTOR"] != 1.0:
        raise ValueError(f"op: the injection mappings share the cache's alpha; {op.name} and {fmt.op.name} differ")
    return {f"{prefix}_PATTERN": pattern, f"{prefix}_SHL": shl, f"{prefix}_PIVOT": fold[f"{prefix}_PIVOT"],
            f"{prefix}_MID": fold[f"{prefix}_MID"]}


def e2m1_decode(bits: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 (FP4) bit patterns (sign, 2 exponent bits, 1 mantissa bit, bias 1)."""
    b = bits.to(torch.int64)
    sign = torch.where((b >> 3) & 1 == 1, -1.0, 1.0).double()
    e = (b >> 1) & 3
    m = (b & 1).double()
    normal = (1.0 + m / 2) * torch.pow(2.0, (e - 1).double())
    sub = m / 2  # exponent 0: 0.m * 2^(1-bias) = m/2
    return sign * torch.where(e == 0, sub, normal)


BF16_INJECTION = injection("bf16", 128)  # 0x4300 | q -> q + 128: the paper's Hopper operand
F16_INJECTION = injection("f16", 1024)  # 0x6400 | q -> q + 1024
E4M3_PLACEMENT = OperandMapping("e4m3", 2.0 ** -9, 0.0, "e4m3", "q in the low bits of a byte  ->  q * 2^-9 (Blackwell)")
E2M1_PLACEMENT = OperandMapping("e2m1", 0.5, 0.0, "e2m1", "q in the low bits of a nibble  ->  q / 2 (Blackwell, INT2)")
MAPPINGS = {m.name: m for m in (BF16_INJECTION, F16_INJECTION, E4M3_PLACEMENT, E2M1_PLACEMENT)}


FP32_MAX = float(torch.finfo(torch.float32).max)


@functools.lru_cache(maxsize=16)
def _max_abs_value(bits: int, mapping: str) -> float:
    op = MAPPINGS[mapping]
    qmax = (1 << bits) - 1
    scale = 2.0 / (qmax * op.alpha)  # s' per unit of M
    reach = abs(op.beta) + (1 << bits) + qmax  # the largest pivot or offset a kernel multiplies s' by
    return 2.0 ** math.floor(math.log2(FP32_MAX / (2.0 ** 31 * max(scale, 1.0 + reach * scale))))


def operand_for(dtype, bits: int) -> OperandMapping:
    """The injection a kernel builds ``dtype`` (BF16 or FP16) operands of ``bits``-bit codes with:
    ``q`` in the top mantissa bits, ``y = q + 2^bits``. Same instruction count as ``0x4300 | q`` (the
    shift moves the field to another bit), but an offset of 16 (INT4) or 4 (INT2) instead of 128:
    the accumulators carry ``beta * s' * sum(P)`` before the correction cancels it, so a smaller
    ``beta`` loses fewer bits to it."""
    return injection("f16" if dtype == torch.float16 else "bf16", 1 << bits)


def inject_pair_bf16(words: torch.Tensor, shift: int | torch.Tensor, bits: int) -> torch.Tensor:
    """The Hopper construction of one 32-bit register: ``((w >> shift) & m) | 0x43004300``.

    ``m`` keeps one ``bits``-wide field at bit 0 and one at bit 16, so the register holds two BF16
    operands ``128 + q``. Returns the two BF16 halves, shape ``words.shape + (2,)`` (low half first).
    """
    mask = ((1 << bits) - 1) * 0x00010001
    w = words.to(torch.int64) & 0xFFFFFFFF
    reg = ((w >> shift) & mask) | 0x43004300
    reg = torch.where(reg >= 2 ** 31, reg - 2 ** 32, reg).to(torch.int32)
    return reg.reshape(-1).view(torch.bfloat16).reshape(*reg.shape, 2)


# --------------------------------------------------------------------------------------------
# The packed layout (docs/layout.md)
# --------------------------------------------------------------------------------------------
@functools.cache
def block_map(bits: int, head_dim: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each code of one pack block lives: ``(word, shift)``, each of shape ``[tokens, head_dim]``.

    K block = 16 tokens x D channels, the A operand of ``S^T = K Q^T`` (rows = tokens, k = channels).
    V block = 64/bits tokens x D channels, the A operand of ``O^T = V^T P^T`` (rows = channels,
    k = tokens). In the m64nNk16 register fragment, thread ``32w + l`` holds in register
    ``4b + j`` the row ``16w + l//4 + 8(j%2)`` and the k pair ``16b + 2(l%4) + 8(j//2) + {0, 1}``
    (low half = even k). A word holds ``16/bits`` consecutive registers of one thread: register
    ``r`` at bits ``bits*(r % (16/bits))`` (low half) and ``16 + bits*(r % (16/bits))`` (high half).
    """
    if tensor == "k":
        t, c = torch.meshgrid(torch.arange(K_BLOCK_TOKENS), torch.arange(head_dim), indexing="ij")
        row, k = t, c  # rows = tokens, k = channels
        warp = torch.zeros_like(t)  # a K block is one warp's 16 rows
        lanes_words = head_dim * bits // 64  # words per lane per block
    elif tensor == "v":
        t, c = torch.meshgrid(torch.arange(v_block_tokens(bits)), torch.arange(head_dim), indexing="ij")
        row, k = c % 64, t  # rows = channels (one m64 half), k = tokens
        warp = row // 16
        lanes_words = head_dim // 64  # one word per m64 half per thread
    else:  # pragma: no cover - internal
        raise ValueError(tensor)
    r16 = row % 16
    kb, k16 = k // 16, k % 16
    lane = 4 * (r16 % 8) + (k16 % 8) // 2
    half = k16 % 2
    j = r16 // 8 + 2 * (k16 // 8)
    reg = 4 * kb + j
    regs_per_word = 16 // bits
    thread = 32 * warp + lane
    if tensor == "k":
        word = thread * lanes_words + reg // regs_per_word
    else:
        word = thread * lanes_words + c // 64  # reg < regs_per_word inside one V block
    shift = bits * (reg % regs_per_word) + 16 * half
    return word.contiguous(), shift.contiguous()


def words_per_block(bits: int, head_dim: int, tensor: str) -> int:
    return block_tokens(bits, tensor) * head_dim * bits // 32


def _check_pack_args(bits: int, tensor: str) -> None:
    check_int("bits", bits, allowed=SUPPORTED_BITS)
    if tensor not in ("k", "v"):
        raise InvalidArgumentError("tensor", "'k' or 'v'", repr(tensor))


def pack_codes(codes: torch.Tensor, bits: int, tensor: str) -> torch.Tensor:
    """Pack codes ``[..., T, D]`` (T a multiple of the pack block) into int32 words ``[..., T*D*bits/32]``."""
    _check_pack_args(bits, tensor)
    if not isinstance(codes, torch.Tensor) or codes.dim() < 2:
        got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise InvalidArgumentError("codes", "a tensor [..., T, D]", got)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise InvalidArgumentError("codes", "an integer dtype", codes.dtype)
    *lead, T, D = codes.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise InvalidArgumentError("codes", f"a last dim (head_dim) in {SUPPORTED_HEAD_DIMS}", D)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << bits)):
        raise InvalidArgumentError("codes", f"codes in [0, {1 << bits})",
                                   f"values in [{int(codes.min())}, {int(codes.max())}]")
    bt = block_tokens(bits, tensor)
    if T % bt:
        raise InvalidArgumentError("codes", f"a token count that is a multiple of {bt}", T)
    word, shift = block_map(bits, D, tensor)
    nb = T // bt
    wpb = words_per_block(bits, D, tensor)
    c = codes.to(torch.int64).reshape(*lead, nb, bt * D) << shift.reshape(-1).to(codes.device)
    out = torch.zeros(*lead, nb, wpb, dtype=torch.int64, device=codes.device)
    out.scatter_add_(-1, word.reshape(-1).to(codes.device).expand_as(c).contiguous(), c)  # disjoint fields
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)
    return out.reshape(*lead, nb * wpb)


def unpack_codes(words: torch.Tensor, bits: int, tensor: str, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 words ``[..., W]`` -> int32 codes ``[..., T, D]``."""
    _check_pack_args(bits, tensor)
    check_int("head_dim", head_dim, allowed=SUPPORTED_HEAD_DIMS)
    if not isinstance(words, torch.Tensor) or words.dim() < 1 or words.dtype != torch.int32:
        raise InvalidArgumentError("words", "an int32 tensor [..., W]", f"{words.dtype} shape {tuple(words.shape)}"
                                   if isinstance(words, torch.Tensor) else type(words).__name__)
    *lead, W = words.shape
    wpb = words_per_block(bits, head_dim, tensor)
    if W % wpb:
        raise InvalidArgumentError("words", f"a last dim that is a multiple of {wpb} (words per pack block)", W)
    bt = block_tokens(bits, tensor)
    nb = W // wpb
    word, shift = block_map(bits, head_dim, tensor)
    w = words.to(torch.int64).reshape(*lead, nb, wpb) & 0xFFFFFFFF
    idx = word.reshape(-1).to(words.device)
    got = torch.index_select(w, -1, idx)
    codes = (got >> shift.reshape(-1).to(words.device)) & ((1 << bits) - 1)
    return codes.to(torch.int32).reshape(*lead, nb * bt, head_dim)


# --------------------------------------------------------------------------------------------
# The format
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVFormat:
    """Everything that fixes how a K/V cache is stored; hashable, so it can key caches of compiled kernels.

    bits: code width (2 or 4). head_dim: 64, 128 or 256. group_size: values sharing one (s, z):
    token-wise groups must divide head_dim (32, 64, 128 or head_dim); channel-wise groups span
    32, 64, 128 or 256 tokens. k_axis / v_axis: "token" or "channel". mapping: the tensor-core
    operand the cache's folded constants are made for ("bf16" injection by default).
    sink / recent: tokens kept unquantized (BF16) at the start / end of each sequence.
    rollback: slots a BF16 recent ring keeps beyond its window (tokens an append moved on to the pages): a cache
    ``rewind`` takes that many back, a step of ``rollback + 1`` tokens reads each one's window; no ring, no limit.
    rotation: ``None``, or ``"hadamard"``: K and V are stored rotated per head by the orthonormal
    :func:`rotation_matrix` (a normalized Walsh-Hadamard transform, with a random +-1 sign per channel
    first when ``rotation_seed`` is given), which spreads outlier channels over every channel before
    quantization; every foscar entry point rotates what it is given and undoes it on what it returns
    (the query in, the output out; LSEs are unchanged), so results are those of the unrotated values.
    scheme: ``"affine"`` (the default: unsigned codes, ``(s, z)`` per group), or an FP4 block format
    (:mod:`foscar.fp4`): ``"nvfp4"`` (E2M1 codes, an E4M3 scale per 16 channels of a token, a per-tensor FP32
    scale) or ``"mxfp4"`` (E2M1, an E8M0 scale per 32): ``bits=4``, ``group_size`` the block, both axes
    token-wise (:meth:`fp4`). A format's values are :meth:`values` of its codes times the group's scale
    (plus its offset: affine).
    """

    bits: int
    head_dim: int
    group_size: int
    k_axis: str = TOKEN
    v_axis: str = TOKEN
    mapping: str = "bf16"
    sink: int = 0
    recent: int = 0
    rotation: str | None = None
    rotation_seed: int | None = None
    scheme: str = AFFINE
    rollback: int = 0
    layout: str = LAYOUT_TAG

    @classmethod
    def fp4(cls, scheme: str, head_dim: int, **kw) -> KVFormat:
        """The FP4 block format ``scheme`` (``"nvfp4"`` or ``"mxfp4"``) at ``head_dim``: 4-bit codes, groups of
        its block, token-wise K and V; ``kw``: the windows, a rotation."""
        from .fp4 import spec_for
        return cls(bits=4, head_dim=head_dim, group_size=spec_for(scheme).block, scheme=scheme, **kw)

    def __post_init__(self):
        check_int("bits", self.bits, allowed=SUPPORTED_BITS)
        check_int("head_dim", self.head_dim, allowed=SUPPORTED_HEAD_DIMS)
        if self.scheme not in SCHEMES:
            raise InvalidArgumentError("scheme", f"one of {SCHEMES}", repr(self.scheme))
        if self.scheme != AFFINE:
            self._check_fp4()
        else:
            check_int("group_size", self.group_size, allowed=SUPPORTED_GROUPS)
        for name in ("k_axis", "v_axis"):
            if getattr(self, name) not in AXES:
                raise InvalidArgumentError(name, f"one of {AXES}", repr(getattr(self, name)))
        if not isinstance(self.mapping, str) or self.mapping not in MAPPINGS:
            raise InvalidArgumentError("mapping", f"one of {tuple(MAPPINGS)}", repr(self.mapping))
        if self.mapping == "e2m1" and self.bits != 2:
            raise UnsupportedError("mapping='e2m1'", f"E2M1 holds 2-bit codes only (bits={self.bits})")
        check_int("sink", self.sink, minimum=0)
        check_int("recent", self.recent, minimum=0)
        check_int("rollback", self.rollback, minimum=0)
        if self.rotation not in ROTATIONS:
            raise InvalidArgumentError("rotation", f"one of {ROTATIONS}", repr(self.rotation))
        if self.rotation_seed is not None:
            if self.rotation is None:
                raise InvalidArgumentError("rotation_seed", "None without a rotation", repr(self.rotation_seed))
            check_int("rotation_seed", self.rotation_seed, minimum=0)
        if self.rotation is not None and self.head_dim & (self.head_dim - 1):
            raise UnsupportedError(f"rotation={self.rotation!r}", f"needs a power-of-two head_dim, not {self.head_dim}")
        if self.layout != LAYOUT_TAG:
            raise UnsupportedError("layout", f"this foscar reads {LAYOUT_TAG!r}, not {self.layout!r}")
        for name in ("k_axis", "v_axis"):
            if getattr(self, name) == TOKEN and self.head_dim % self.group_size:
                raise UnsupportedError(
                    f"{name}='token' with group_size={self.group_size}",
                    f"a token-wise group spans channels, so it must divide head_dim={self.head_dim}")

    def _check_fp4(self) -> None:
        from .fp4 import spec_for
        spec = spec_for(self.scheme)
        got = {"bits": self.bits, "group_size": self.group_size, "k_axis": self.k_axis, "v_axis": self.v_axis,
               "mapping": self.mapping}
        want = {"bits": 4, "group_size": spec.block, "k_axis": TOKEN, "v_axis": TOKEN, "mapping": "bf16"}
        for name, value in want.items():
            if got[name] != value:
                raise UnsupportedError(f"{name}={got[name]!r} with scheme={self.scheme!r}",
                                       f"{self.scheme} is 4-bit E2M1 codes in token-wise blocks of {spec.block} "
                                       f"channels for K and V ({name}={value!r}; KVFormat.fp4 makes it)")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def op(self) -> OperandMapping:
        return MAPPINGS[self.mapping]

    @property
    def is_fp4(self) -> bool:
        """Whether the codes are E2M1 in FP4 blocks (:mod:`foscar.fp4`), not affine."""
        return self.scheme != AFFINE

    @property
    def fp4_spec(self):
        """The :class:`foscar.fp4.Fp4Spec` of an FP4 format (``None``: affine)."""
        from .fp4 import spec_for
        return spec_for(self.scheme) if self.is_fp4 else None

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """What the codes ``q`` are worth before the group's scale, float64: the operand ``y`` the affine
        cache's ``(s', z')`` are folded for (``x = s' y + z'``), or the E2M1 value (``x = s v``)."""
        return e2m1_decode(codes) if self.is_fp4 else self.op.construct(codes)

    def axis(self, tensor: str) -> str:
        return self.k_axis if tensor == "k" else self.v_axis

    @property
    def flush(self) -> int:
        """Tokens quantized at once: a whole group when either tensor groups along tokens."""
        return self.group_size if CHANNEL in (self.k_axis, self.v_axis) else 1

    @property
    def recent_capacity(self) -> int:
        """Slots of the BF16 recent ring: window, incomplete group, and with a ring :attr:`rollback`."""
        ring = self.recent + self.flush - 1
        return ring + self.rollback if ring else 0

    def ring_keep_from(self, length):
        """The post-sink position from which an append leaving ``length`` tokens (ints or int tensors) writes the
        new tokens into the ring, which then holds every token from there on: the window's (``n_quant``), or with
        :attr:`rollback` the last :attr:`recent_capacity` (the tokens a rewind takes back into the window)."""
        _, n_quant, n_recent = self.split_length(length)
        if not self.rollback:
            return n_quant
        first = n_quant + n_recent - self.recent_capacity  # the last recent_capacity post-sink tokens
        return first.clamp(min=0) if isinstance(first, torch.Tensor) else max(first, 0)

    @property
    def token_alignment(self) -> int:
        """Page sizes (and contiguous capacities) must be multiples of this."""
        return math.lcm(PAGE_QUANTUM, v_block_tokens(self.bits))

    def split_length(self, length):
        """``(n_sink, n_quant, n_recent)`` of a sequence of ``length`` tokens (ints or int tensors).

        The first ``sink`` tokens stay BF16; of the rest, all but the last ``recent`` are quantized,
        rounded down to a multiple of :attr:`flush`; the remainder stays in the BF16 recent ring.
        """
        if isinstance(length, torch.Tensor):
            n_sink = torch.clamp(length, max=self.sink)
            rest = length - n_sink
            n_quant = torch.div(torch.clamp(rest - self.recent, min=0), self.flush, rounding_mode="floor") * self.flush
        else:
            n_sink = min(length, self.sink)
            rest = length - n_sink
            n_quant = max(0, rest - self.recent) // self.flush * self.flush
        return n_sink, n_quant, rest - n_quant

    def param_shape(self, tensor: str, tokens: int) -> tuple[int, int]:
        """(rows, cols) of the (s', z') table for ``tokens`` consecutive quantized tokens.

        Token-wise: one row per token, one column per channel group. Channel-wise: one row per
        token group (a page shorter than a group still holds the row of the group it lies in),
        one column per channel.
        """
        g, D = self.group_size, self.head_dim
        if self.axis(tensor) == TOKEN:
            return tokens, D // g
        return max(1, tokens // g), D

    def check_page_size(self, page_size: int, name: str = "page_size") -> int:
        check_int(name, page_size, minimum=1)
        a = self.token_alignment
        if page_size % a:
            raise UnsupportedError(f"{name}={page_size}",
                                   f"pages of a {self.bits}-bit cache with these axes hold multiples of {a} tokens")
        if CHANNEL in (self.k_axis, self.v_axis):
            g = self.group_size
            if page_size % g and g % page_size:
                raise UnsupportedError(f"{name}={page_size}",
                                       f"channel-wise groups of {g} tokens need the page to divide, or be a multiple of, {g}")
        return page_size

    def words_per_page(self, tensor: str, page_size: int) -> int:
        return page_size * self.head_dim * self.bits // 32

    @property
    def max_abs_value(self) -> float:
        """The largest magnitude a stored value may have: a power of two at which no FP32 number a decode
        forms can overflow, at any length an int32 holds. A group's folded constants are at most
        ``s' <= 2M / (qmax*alpha)`` and ``|z'| <= M + |beta| s'``, a kernel's middle value ``z' + c s'`` (``c``
        at most ``|beta| + 2^bits + qmax``, the re-based pivot), and the unnormalised softmax sums
        ``sum_t p_t x_t`` (``p_t <= 1``) up to ``2^31`` times that. The write paths refuse larger values by
        name, rather than store or compute an infinity. Scores ``q.k`` are the query's: a query large
        enough to overflow them gives a NaN output."""
        return _max_abs_value(self.bits, self.mapping)

    # ---- what a cache can store ---------------------------------------------------------------
    @property
    def passes_window(self) -> bool:
        """Whether every post-sink token passes through the recent ring before it is quantized (a ring
        exists: ``recent > 0`` or a channel-wise axis). Appending in chunks then quantizes each token from
        the window dtype, so every write path does: :meth:`as_quantized`."""
        return self.recent_capacity > 0

    def as_quantized(self, x: torch.Tensor, window_dtype: torch.dtype) -> torch.Tensor:
        """The values the quantizer reads for post-sink tokens ``x``: rounded to ``window_dtype`` when the
        tokens pass the recent ring (:attr:`passes_window`), else as given. Every write path quantizes
        these, so a cache is the same whatever the chunking of its appends."""
        return x.to(window_dtype) if self.passes_window else x

    def check_storable(self, name: str, x: torch.Tensor, window_dtype: torch.dtype, first: int,
                       index: tuple = ()) -> None:
        """Refuse values of tokens ``first, first + 1, ...`` of one sequence (``x [H, T, D]``, finite) that
        the cache cannot hold: a token kept in a window (the sink, or any token when the format has a
        recent ring) must be finite in ``window_dtype``, and every value at most :attr:`max_abs_value` in
        magnitude. ``index`` prefixes the reported index (the sequence)."""
        if not x.numel():
            return
        pos = first + torch.arange(x.shape[1], device=x.device)
        windowed = (pos < self.sink) | self.passes_window
        stored = torch.where(windowed[None, :, None], x.to(window_dtype).to(x.dtype), x)
        bad = windowed[None, :, None] & ~torch.isfinite(stored)
        if bool(bad.any()):
            i = tuple(bad.nonzero()[0].tolist())
            lim = torch.finfo(window_dtype).max
            raise InvalidArgumentError(name, f"values the {str(window_dtype).replace('torch.', '')} windows hold "
                                       f"(|x| <= {lim:.6g})", f"{x[i].item()} at index {index + i}")
        self.check_magnitude(name, stored, index)

    def check_magnitude(self, name: str, x: torch.Tensor, index: tuple = ()) -> None:
        """Refuse stored values past :attr:`max_abs_value` (``index`` prefixes the reported index)."""
        limit = self.max_abs_value
        bad = x.abs() > limit
        if x.numel() and bool(bad.any()):
            i = tuple(bad.nonzero()[0].tolist())
            raise InvalidArgumentError(name, f"values of magnitude <= {limit:.4g} (what FP32 decode arithmetic "
                                       f"holds for {self.bits}-bit codes, mapping {self.mapping!r})",
                                       f"{x[i].item()} at index {index + i}")

    def check_folded(self, names: tuple[str, str], s: torch.Tensor, z: torch.Tensor) -> None:
        """Refuse given ``(s, z)`` of ``x = s*q + z`` whose group values ``z`` and ``z + s*qmax`` exceed
        :attr:`max_abs_value` (their FP32 ``(s', z')`` would overflow, or a kernel's middle value would):
        named ``names[1]`` (the offset) when ``z`` is out of range, else ``names[0]`` (the scale)."""
        if not s.numel():
            return
        limit = self.max_abs_value
        s, z = s.double(), z.double()
        z_bad = z.abs() > limit
        bad = z_bad | ((z + s * ((1 << self.bits) - 1)).abs() > limit)
        if bool(bad.any()):
            i = tuple(bad.nonzero()[0].tolist())
            name = names[1] if bool(z_bad[i]) else names[0]
            raise InvalidArgumentError(name, f"groups whose values z .. z + s*{(1 << self.bits) - 1} lie within "
                                       f"+-{limit:.4g} (FP32 folded constants for mapping {self.mapping!r})",
                                       f"s={s[i].item():.6g}, z={z[i].item():.6g} at index {i}")

    def bytes_per_token(self) -> float:
        """HBM bytes one quantized token costs per KV head, K and V together (codes + s' + z', or the FP4
        codes and block-scale bytes)."""
        if self.is_fp4:
            return 2 * self.fp4_spec.bytes_per_token(self.head_dim)
        per = self.head_dim * self.bits / 8 + 8 * self.head_dim / self.group_size
        return 2 * per
