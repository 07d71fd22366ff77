"""The cache layout is the register fragment CuTe DSL builds for Hopper ``wgmma.m64nNk16`` with A from
registers. The index functions the CuTe kernels trace to build their A registers
(``foscar.cute.fragment.k_word``/``v_word``: which word a thread loads; ``k_register_source``/
``v_register_source``: which word and bit a register comes from), evaluated here on the host for every
thread, register and half (``tile_register_source``), give the word and bit :func:`foscar.format.block_map`
puts the code of the element CuTe assigns to that slot (``rs_fragment_ownership``, traced on the host: no
GPU)."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # trace and compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

from foscar.cute.fragment import TILE_TOKENS, rs_fragment_ownership, tile_register_source, tile_words  # noqa: E402
from foscar.format import block_map, block_tokens, pack_codes, words_per_block  # noqa: E402

from _helpers import cute_switches  # noqa: E402


def decode(words, word, shift, bits):
    w = words.long() & 0xFFFFFFFF
    return (w[word] >> shift) & ((1 << bits) - 1)


def ownership(tensor, head_dim):
    """(token, channel) of the element CuTe assigns to each (thread, register, half) of the tile's A operand."""
    if tensor == "k":  # S^T = K Q^T: rows = tokens, k = channels
        own = rs_fragment_ownership(TILE_TOKENS, head_dim)
        return own[..., 0], own[..., 1]
    own = rs_fragment_ownership(head_dim, TILE_TOKENS)  # O^T = V^T P^T: rows = channels, k = tokens
    return own[..., 1], own[..., 0]


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("tensor", ("k", "v"))
def test_index_functions_are_the_block_map(tensor, bits, head_dim):
    if head_dim == 256 and bits == 2 and os.environ.get("FOSCAR_SLOW") != "1":
        pytest.skip("slow (ten seconds a tensor on a CPU; INT4 at 256 runs): set FOSCAR_SLOW=1 to run it")
    """For every thread, register and half: the kernels' (word, bit) is block_map's for CuTe's element."""
    token, channel = ownership(tensor, head_dim)
    assert (token >= 0).all(), "a fragment slot CuTe did not assign"
    block = block_tokens(bits, tensor)
    map_word, map_shift = block_map(bits, head_dim, tensor)
    expected_word = token // block * words_per_block(bits, head_dim, tensor) + map_word[token % block, channel]
    word, shift = tile_register_source(bits, head_dim, tensor)
    assert torch.equal(word, expected_word)
    assert torch.equal(shift, map_shift[token % block, channel])


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("tensor", ("k", "v"))
def test_packed_tile_feeds_the_cute_fragment(tensor, bits, head_dim):
    gen = torch.Generator().manual_seed(bits * 1000 + head_dim)
    codes = torch.randint(0, 1 << bits, (TILE_TOKENS, head_dim), generator=gen, dtype=torch.int32)
    words = pack_codes(codes, bits, tensor)
    assert words.numel() == tile_words(bits, head_dim, tensor)
    word, shift = tile_register_source(bits, head_dim, tensor)
    token, channel = ownership(tensor, head_dim)
    assert torch.equal(decode(words, word, shift, bits), codes[token, channel].long())
    # every word of the tile is read, by exactly one thread
    readers = torch.zeros(words.numel(), dtype=torch.long)
    for t in range(word.shape[0]):
        readers[word[t].unique()] += 1
    assert bool((readers == 1).all())


def test_the_kernels_trace_the_index_functions(monkeypatch):
    """Both kernels build their A registers and load their words through the functions checked above."""
    import foscar
    from foscar.cute import fragment, kernel_v0, kernel_v1, operands
    from foscar.cute.compile import compile_stage1
    from foscar.cute.config import config_for, consumer_code_paths
    calls = {}

    def spy(module, name):
        real = getattr(fragment, name)

        def wrapper(*args):
            calls[(module.__name__, name)] = calls.get((module.__name__, name), 0) + 1
            return real(*args)
        monkeypatch.setattr(module, name, wrapper)

    for module, names in ((operands, ("k_register_source", "v_register_source")), (kernel_v0, ("k_word", "v_word")),
                          (kernel_v1, ("k_word", "v_word"))):
        for name in names:
            spy(module, name)
    cfg = config_for(foscar.KVFormat(bits=4, head_dim=64, group_size=64), 4, 64)
    compile_stage1(cfg)  # v0: one tile step, the first tile's words loaded before the loop and the next in it
    compile_stage1(cfg, warp_specialized=True)  # v1: each copy of the consumers' code, its tile step and stage reads
    copies = consumer_code_paths(cfg, 1)
    k_regs, v_regs = TILE_TOKENS * cfg.head_dim // 2 // 128, 4 * cfg.mh * TILE_TOKENS // 16
    v_words = cfg.v_blocks * cfg.mh
    assert calls == {("foscar.cute.operands", "k_register_source"): (1 + copies) * k_regs,
                     ("foscar.cute.operands", "v_register_source"): (1 + copies) * v_regs,
                     ("foscar.cute.kernel_v0", "k_word"): 2 * cfg.k_words,
                     ("foscar.cute.kernel_v0", "v_word"): 2 * v_words,
                     ("foscar.cute.kernel_v1", "k_word"): copies * cfg.k_words,
                     ("foscar.cute.kernel_v1", "v_word"): copies * v_words}


@pytest.mark.parametrize("m", (64, 128, 256))
def test_accumulator_ownership(m):
    """What the kernels assume of the C fragment (``S^T`` with m = 64, ``O^T`` with m = head_dim): thread
    32w + l holds in register e = v0 + 2 v1 + 4 mt the row 64 mt + 16 w + l // 4 + 8 v1 and the column
    2 (l % 4) + v0."""
    from foscar.cute.fragment import rs_accumulator_ownership
    own = rs_accumulator_ownership(m)
    t = torch.arange(128)[:, None]
    e = torch.arange(m * 8 // 128)[None, :]
    w, lane = t // 32, t % 32
    v0, v1, mt = e % 2, (e // 2) % 2, e // 4
    assert torch.equal(own[..., 0], 64 * mt + 16 * w + lane // 4 + 8 * v1)
    assert torch.equal(own[..., 1], 2 * (lane % 4) + v0 + 0 * mt)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("v_axis,low,rows,chan", [("channel", False, False, False), ("channel", True, False, True),
                                                  ("token", False, False, False), ("token", True, False, False),
                                                  ("token", True, True, False)])
def test_vt_registers_hold_code_plus_their_token_halfs_offset(monkeypatch, v_axis, low, rows, chan, bits, head_dim):
    """V^T's FP16 registers as ``operands.build_vt_registers`` builds them (a word rotated by the config's
    placement of the register's token half, one ``lop3``) hold ``q + beta_h`` for CuTe's element, ``h`` the
    token half of its k16 block, whose pivot ``v_operand_fold`` takes; fewer rotations than one placement.
    Token-wise V's are placed: ``q 2^(shl_h - 24)``, ``q`` times the half's P' factor over the
    accumulator's unit, no offset (the pivot, in the accumulator's units, is the middle code's operand); from bit
    0 (``V_LOW_PLACEMENT``) with fewer rotations; by channel-row class too (``V_ROW_SHIFTS``: ``2^b_c`` more for
    the rows +8 of a 16, ``v_row_class``), one rotation a word. Channel-wise V injected at one bit, or placed as
    token-wise V is (``V_CHANNEL_PLACEMENT``: ``chan``)."""
    import foscar
    from foscar.cute.config import config_for
    from foscar.cute.fragment import v_register_source, v_rotations, v_row_class, v_token_half
    placed = v_axis == "token" or chan
    with cute_switches(monkeypatch, V_LOW_PLACEMENT=low, V_ROW_SHIFTS=rows, V_CHANNEL_PLACEMENT=chan):
        cfg = config_for(foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=64 if head_dim < 256 else 128,
                                         v_axis=v_axis), 4, 64)
    assert (cfg.v_row_shls != (0, 0)) == rows
    mid = ((1 << bits) - 1) / 2
    gen = torch.Generator().manual_seed(7 * bits + head_dim)
    codes = torch.randint(0, 1 << bits, (TILE_TOKENS, head_dim), generator=gen, dtype=torch.int32)
    words = pack_codes(codes, bits, "v").long() & 0xFFFFFFFF
    word, _ = tile_register_source(bits, head_dim, "v")
    token, channel = ownership("v", head_dim)
    for r in range(word.shape[1]):
        h, c = v_token_half(r), v_row_class(r)
        assert bool(((token[:, r] % 16) // 8 == h).all()), "the register's tokens are not its token half"
        assert bool(((channel[:, r] % 16) // 8 == c).all()), "the register's channels are not its row class"
        shl, pattern = cfg.v_shls[h] + cfg.v_row_shls[c], cfg.v_patterns[h]
        rot = (v_register_source(bits, head_dim, r)[2] - shl) % 32
        w = words[word[:, r, 0]]
        x = ((w >> rot) | (w << (32 - rot))) & 0xFFFFFFFF
        reg = (x & ((((1 << bits) - 1) << shl) * 0x00010001)) | (pattern * 0x00010001)
        halves = torch.stack([reg & 0xFFFF, reg >> 16], -1).to(torch.int32).to(torch.int16)
        value = halves.view(torch.float16).double() * cfg.v_unit * cfg.v_factors[h] / 2 ** cfg.v_row_shls[c]  # exact
        beta = cfg.v_pivots[h] * cfg.v_factors[h] - mid
        assert beta == 0 or not placed
        assert torch.equal(value, codes[token[:, r], channel[:, r]].double() + beta)
    uniform = len(v_rotations(bits, head_dim, (10 - bits,) * 2) - {0})
    n = len(v_rotations(bits, head_dim, cfg.v_shls, cfg.v_row_shls) - {0})
    assert n < uniform if placed else n == uniform
    if low:  # INT2 3, INT4 2 rotations a word (from 4 and 3); by row class 1
        assert n == (1 if rows else {2: 3, 4: 2}[bits])


@pytest.mark.parametrize("m,n", [(64, 8), (64, 16), (64, 32), (128, 16), (128, 32), (256, 8)])
def test_column_slots_are_cutes_accumulator(m, n):
    """The kernels' map of accumulator element ``e`` to its column slot and token row (``s_slot``, ``o_slot``,
    ``row_half``, ``o_block``, ``slot_column``: plain Python at trace time) is CuTe's C fragment of the
    ``(64, n)`` tiled MMA, for S^T (m 64) and O^T (m the head dim)."""
    from foscar.cute.fragment import o_block, o_slot, row_half, s_slot, slot_column, slot_elements
    from foscar.cute.fragment import rs_accumulator_ownership
    own = rs_accumulator_ownership(m, n)
    nb = n // 8
    if m == 64:  # a column slot's two elements: its token rows row0 and row0 + 8
        for k in range(2 * nb):
            assert [(s_slot(e), row_half(e)) for e in slot_elements(k)] == [(k, 0), (k, 1)]
    t = torch.arange(128)
    w, lane = t // 32, t % 32
    for e in range(own.shape[1]):
        slot = s_slot(e) if m == 64 else o_slot(e, nb)
        col = torch.tensor([slot_column(slot, 2 * int(q)) for q in lane % 4])
        row = 64 * (0 if m == 64 else o_block(e, nb)) + 16 * w + lane // 4 + 8 * row_half(e)
        assert torch.equal(own[:, e, 1], col), e
        assert torch.equal(own[:, e, 0], row), e


@pytest.mark.parametrize("threads", (128, 32))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("cols", (8, 16, 32))
def test_the_fold_chunks_cover_q_once(head_dim, cols, threads):
    """Channel-wise K's ``Q'``: the shares of :data:`FOLD_CHANNELS` channels that ``threads`` threads build
    (``fold_chunk``, ``fold_channel``: a consumer warpgroup, or one warp of the producer's,
    :mod:`foscar.cute.producer_fold`) cover every (row, channel) of the kernel's columns once; a row's builders are
    consecutive lanes of one warp (its correction is their butterfly sum); each of a row's pairs is one 32-bit word,
    and the builders' ``(s', z')`` of one pair step (``fold_param``) are consecutive 16-byte words of the group's
    row."""
    from types import SimpleNamespace

    from foscar.cute.fold_map import FOLD_CHANNELS, FOLD_PAIRS, fold_channel, fold_chunk, fold_chunks, fold_param
    cfg = SimpleNamespace(head_dim=head_dim, cols=cols)
    seen = torch.zeros(cols, head_dim, dtype=torch.long)
    lanes = {}
    for t in range(threads):
        for j in range(fold_chunks(cfg, threads)):
            row, c = fold_chunk(head_dim, t, j, threads)
            if row < cols:
                for i in range(FOLD_CHANNELS):
                    seen[row, fold_channel(head_dim, c, i)] += 1
                lanes.setdefault((row, t // 32), []).append(t % 32)
    assert bool((seen == 1).all())
    for lane_list in lanes.values():  # one warp, consecutive, aligned to their count (a butterfly group)
        n = len(lane_list)
        assert n == head_dim // FOLD_CHANNELS and lane_list == list(range(lane_list[0], lane_list[0] + n))
        assert lane_list[0] % n == 0
    builders = head_dim // FOLD_CHANNELS
    for p in range(FOLD_PAIRS):
        assert fold_channel(head_dim, 0, 2 * p) % 2 == 0 and fold_channel(head_dim, 0, 2 * p + 1) == \
            fold_channel(head_dim, 0, 2 * p) + 1
        words = [fold_param(head_dim, c, 4 * p) for c in range(builders)]  # each builder's first float of pair p
        assert words == list(range(words[0], words[0] + 4 * builders, 4)) and words[0] % 4 == 0
        assert [fold_param(head_dim, 0, 4 * p + k) for k in range(4)] == list(range(words[0], words[0] + 4))


def test_a_pass_takes_its_consumers_next_two_tiles_from_the_ring():
    """Two tiles a pass (``pass_tiles``): consumer ``c``'s ``j``-th pass takes tiles A and B that the producer put in
    its ``k``-th and ``k + 1``-th slots (``ring_tile``), ``k`` even, every tile of a split once; with runs of two
    both tiles lie in one token group of two tiles and tile A's slot is even (the producer's ``Q'`` fold of a pass:
    ``FoldDecodeSm90WS._folded_slot``), and consumer ``c``'s fold warp
    (:func:`foscar.cute.producer_fold.fold_stages`: its ``k``-th tiles, ``k`` even, below ``run_bound``) meets
    exactly its passes' tiles A, in their order, each pass in flight its own ``Q'`` buffer
    (:func:`~foscar.cute.ring.fold_buffer`). Three consumers (``WIDE_EIGHT_COLUMNS``) take alternate tiles in runs
    of one."""
    from foscar.cute.ring import fold_buffer, pass_tiles, ring_slot, ring_tile, run_bound, run_tile
    for run, consumers in ((1, 2), (2, 2), (1, 3)):
        for n in range(1, 23):
            seen = []
            for c in range(consumers):
                for i in range(run * c, n, 2 * consumers):
                    k, i_b = pass_tiles(i, run, consumers)
                    assert k % 2 == 0 and ring_tile(i, run, consumers) == (c, k)
                    assert ring_tile(i_b, run, consumers) == (c, k + 1)
                    assert all(ring_slot(c, k + 1, stages) == ring_slot(c, k, stages) + 1 for stages in (2, 4, 8))
                    seen += [i] + ([i_b] if i_b < n else [])
                    if run == 2:
                        assert i % 2 == 0 and i_b == i + 1  # one group of two tiles (splits start at even tiles)
                        assert all(ring_slot(c, k, stages) % 2 == 0 for stages in (4, 8, 16))
            assert sorted(seen) == list(range(n))
            if consumers == 2:  # the fold warps' loops
                for c in range(2):
                    folded = [run_tile(c, k, run) for k in range(0, run_bound(n), 2) if run_tile(c, k, run) < n]
                    assert folded == list(range(run * c, n, 4))
                for stages in (4, 8, 16):  # a pass's buffer: its consumer's, none other in its ring at once
                    bufs = [fold_buffer(ring_slot(c, k, stages), 2) for c in range(2) for k in range(0, stages, 2)]
                    assert sorted(bufs) == list(range(stages))


@pytest.mark.parametrize("group_size", (64, 128, 256))
@pytest.mark.parametrize("consumers", (1, 2))
def test_a_warpgroups_token_groups_alternate_between_the_q_buffers(group_size, consumers):
    """``k_fold_buffer``: over every (run-aligned) split start, the token groups one warpgroup visits (its runs of
    ``tile_run`` tiles, one in every ``consumers``: ``ring_tile``) take alternating ``Q'`` buffers, so that a fold
    never writes the buffer the previous one filled; ``ring_tile`` and ``run_tile`` are inverse, and a run of two
    tiles is one token group, so that each consumer folds once per group."""
    from types import SimpleNamespace

    from foscar.cute.config import TILE
    from foscar.cute.fold_map import k_fold_buffer
    from foscar.cute.ring import ring_tile, run_bound, run_tile
    for n in range(-3, 13):  # run_bound: the k up to it whose tile is in the split are each consumer's tiles
        for c in (0, 1):
            assert [run_tile(c, k, 2) for k in range(max(run_bound(n), 0)) if run_tile(c, k, 2) < n] == \
                [i for i in range(n) if ring_tile(i, 2)[0] == c]
    runs = (1, 2) if consumers == 2 and group_size >= 2 * TILE else (1,)
    for run in runs:
        cfg = SimpleNamespace(group_size=group_size, tile_run=run)
        for t_lo in range(0, 9 * run, run):
            n = 40
            if consumers == 2:  # the consumers' tiles are the split's, each once
                assert sorted(run_tile(c, k, run) for c in range(consumers) for k in range(n // consumers)) == \
                    list(range(n))
            for c in range(consumers):
                visited = []  # (group, buffer) at each group change
                for k in range(n // consumers):
                    i = run_tile(c, k, run) if consumers == 2 else k
                    if consumers == 2:
                        assert ring_tile(i, run) == (c, k)
                    tile = t_lo + i
                    grp = tile * TILE // group_size
                    if not visited or visited[-1][0] != grp:
                        visited.append((grp, k_fold_buffer(cfg, tile * TILE, consumers)))
                bufs = [b for _, b in visited]
                assert all(a != b for a, b in zip(bufs, bufs[1:])), (run, t_lo, c, visited)
                if run == 2 and group_size == 2 * TILE:  # one fold per run: as many groups as runs
                    assert len(visited) == n // consumers // run, (t_lo, c, visited)
