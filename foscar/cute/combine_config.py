"""Static configuration of the CuTe split merge (:mod:`foscar.cute.combine`) and of the BF16 windows it attends
(:mod:`foscar.cute.windows`): :class:`CombineConfig` (the compile-cache key), the chunk of partials loaded
together, the query rows of one CTA and the window's stages. Plain Python, as :mod:`foscar.cute.config`;
the switches that choose the combine's launch live there, the choice here (:func:`dependent_combine`).
"""
from __future__ import annotations

from dataclasses import dataclass

#: The combine's arguments, in order: (name, element type, rank); ``out`` has the config's element type.
COMBINE_TENSORS = (("partial_out", "f32", 4), ("partial_lse", "f32", 3), ("out", None, 3), ("lse", "f32", 2),
                   ("rotation", "f32", 1))
#: A combine with windows takes these after :data:`COMBINE_TENSORS`, then the base-2 softmax scale (None: window_dtype)
COMBINE_WINDOW_TENSORS = (("q", "bf16", 3), ("k_sink", None, 4), ("v_sink", None, 4), ("k_recent", None, 4),
                          ("v_recent", None, 4), ("seq_lens", "i32", 1))
#: The combine's chunks (partials loaded together before they are merged): powers of two up to this.
COMBINE_MAX_CHUNK = 128
#: The partials one combine thread loads per chunk (its registers: 64 outputs fit without a spill).
COMBINE_THREAD_CHUNK = 64
#: The most query rows of one KV head a windowed combine CTA merges (each thread takes its channel of every row)
WINDOW_MAX_ROWS = 8
#: Window vectors (16 bytes of K or V) one thread has in flight while it stages the window: a stage of
#: :attr:`CombineConfig.window_stage` tokens is one round trip to memory
WINDOW_BATCH = 20
#: The most shared memory of a stage's K and V rows
WINDOW_STAGE_BYTES = 64 * 1024
#: Threads that share one (query row, window token) score, each ``head_dim / 8`` channels (three shuffles)
WINDOW_SCORE_LANES = 8


@dataclass(frozen=True)
class CombineConfig:
    """Static configuration of the compiled LSE combine (:mod:`foscar.cute.combine`): the head dim, the
    output's element type (``"bf16"``, ``"f16"`` or ``"f32"``: the query's), whether it writes the LSE,
    and the chunk: partials whose loads are issued together before they are merged (:func:`combine_chunk`:
    all of them in one round trip up to :data:`COMBINE_MAX_CHUNK`)."""

    head_dim: int
    out_dtype: str
    write_lse: bool
    chunk: int
    rotate: bool = False  #: rotate the merged output back out of a rotated cache's space (:mod:`foscar.cute.rotation`)
    #: launched as a programmatic dependent of stage 1 (:data:`~foscar.cute.config.COMBINE_PDL`): it waits for
    #: stage 1's grid before its first read of the partials
    pdl: bool = False
    #: the windows the combine attends (:mod:`foscar.cute.windows`): ``sink``, ``recent``, ``flush`` as ``KVFormat``'s,
    #: ``ring`` its ``recent_capacity``, ``gqa``, ``window_dtype`` ``"bf16"``/``"f16"``; none: ``sink = ring = 0``
    sink: int = 0
    recent: int = 0
    flush: int = 1
    ring: int = 0
    gqa: int = 1
    window_dtype: str = "bf16"
    #: the rows are those of steps of ``step`` tokens (row ``b`` token ``b % step`` of sequence ``b // step``),
    #: ending ``tail`` tokens before the sequence's (:attr:`foscar.cute.config.Sm90Config.tail`): each row attends
    #: the window tokens it sees (:func:`foscar.cute.windows.window_state`)
    step: int = 1
    tail: int = 0

    @property
    def windows(self) -> bool:
        """Whether the combine attends windows (and takes :data:`COMBINE_WINDOW_TENSORS`)."""
        return self.sink + self.ring > 0

    @property
    def thread_chunk(self) -> int:
        """The partials of a chunk one thread loads."""
        return min(self.chunk, COMBINE_THREAD_CHUNK)

    @property
    def ranks(self) -> int:
        """Threads per channel: each takes ``thread_chunk`` of a chunk's partials."""
        return self.chunk // self.thread_chunk

    @property
    def threads(self) -> int:
        """Threads of one CTA: ``ranks`` per channel."""
        return self.head_dim * self.ranks

    @property
    def rows(self) -> int:
        """Query rows of one KV head a CTA merges, each thread its channel of every row: with windows, the largest
        divisor of ``gqa`` up to :data:`WINDOW_MAX_ROWS` whose partials a thread loads together in
        :data:`COMBINE_THREAD_CHUNK` registers, so that a KV head's window is read by as few CTAs as that allows;
        else one."""
        if not self.windows:
            return 1
        return max(r for r in range(1, min(self.gqa, WINDOW_MAX_ROWS) + 1)
                   if self.gqa % r == 0 and r * self.thread_chunk <= COMBINE_THREAD_CHUNK)

    @property
    def window_tokens(self) -> int:
        """The most tokens of one window (its sink and ring slots)."""
        return self.sink + self.ring

    @property
    def window_stage(self) -> int:
        """Window tokens staged in shared memory at a time: :data:`WINDOW_BATCH` vectors a thread, within
        :data:`WINDOW_STAGE_BYTES` of K and V rows."""
        per_token = 2 * self.head_dim // 8  # K's and V's 16-byte vectors
        return min(self.window_tokens, WINDOW_BATCH * self.threads // per_token,
                   WINDOW_STAGE_BYTES // (4 * self.head_dim))


def combine_chunk(parts: int) -> int:
    """The combine's chunk for ``parts`` partials: the next power of two, 8 to :data:`COMBINE_MAX_CHUNK`
    (one compiled variant per bucket)."""
    chunk = 8
    while chunk < min(parts, COMBINE_MAX_CHUNK):
        chunk *= 2
    return chunk


def combine_attends_windows(fmt) -> bool:
    """Whether the CuTe combine attends ``fmt``'s BF16 windows (:data:`foscar.cute.config.COMBINE_WINDOWS`, a format
    with windows)."""
    from ..splitkv import num_window_parts
    from . import config
    return config.COMBINE_WINDOWS and num_window_parts(fmt) > 0


def dependent_combine(fmt, warp_specialized: bool, ctas_per_sm: int) -> bool:
    """Whether a decode's combine launches as a programmatic dependent of stage 1 (``COMBINE_PDL`` of
    :mod:`foscar.cute.config`, or ``COMBINE_PDL_WINDOWS`` where the combine attends ``fmt``'s windows and v1 runs
    two CTAs an SM: at one, stage 1 fills the SMs it takes and the waiting combine CTAs crowd the few it leaves:
    slower there, ``docs/bench/h200/window-cost-kv-head.md``). Stage 1 signals such a combine
    (``Sm90Config.trigger_dependents``)."""
    from . import config
    return config.COMBINE_PDL or (config.COMBINE_PDL_WINDOWS and combine_attends_windows(fmt) and warp_specialized
                                  and ctas_per_sm > 1)
