"""The decode problems of the property-based tests: :func:`decode_case` draws a format of every option (axes,
group sizes, operand mappings, windows, rotation) or an FP4 block format, with lengths, GQA ratio, page size and
value ranges; :func:`build` makes its query and cache on a shuffled page pool; :data:`PAPER` is the paper's shape
as such a case."""
import torch
from _helpers import random_values
from hypothesis import assume
from hypothesis import strategies as st

import foscar
from foscar.errors import InvalidArgumentError, UnsupportedError

AXES = ("token", "channel")


@st.composite
def decode_case(draw, fp4: bool = False):
    """A decode problem: an affine format of every option, or (``fp4``) an NVFP4 / MXFP4 block format."""
    bits = draw(st.sampled_from((2, 4)))
    D = draw(st.sampled_from((64, 128, 256)))
    k_axis, v_axis = draw(st.sampled_from(AXES)), draw(st.sampled_from(AXES))
    token_wise = "token" in (k_axis, v_axis)
    g = draw(st.sampled_from([g for g in (32, 64, 128, 256) if not token_wise or D % g == 0]))
    mapping = draw(st.sampled_from(("bf16", "e4m3") + (("e2m1",) if bits == 2 else ())))
    sink = draw(st.sampled_from((0, 0, 1, 4)))
    recent = draw(st.sampled_from((0, 0, 3, 16)))
    rotation = draw(st.sampled_from((None, None, "hadamard")))
    seed = draw(st.sampled_from((None, 0, 7))) if rotation else None
    if fp4:
        fmt = foscar.KVFormat.fp4(draw(st.sampled_from(("nvfp4", "mxfp4"))), D, sink=sink, recent=recent,
                                  rotation=rotation, rotation_seed=seed)
    else:
        fmt = foscar.KVFormat(bits=bits, head_dim=D, group_size=g, k_axis=k_axis, v_axis=v_axis, mapping=mapping,
                              sink=sink, recent=recent, rotation=rotation, rotation_seed=seed)
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from((1, 2, 3, 4, 7, 8, 16, 32)))
    B = draw(st.integers(1, 3))
    long = draw(st.booleans())
    hi = 2500 if long and G * Hkv * D <= 2048 else 300
    lens = draw(st.lists(st.one_of(st.integers(1, hi), st.sampled_from((1, 2, 17, 63, 64, 65, 127, 129))),
                         min_size=B, max_size=B))
    page = draw(st.sampled_from((None, 16, 32, 48, 64, 128)))
    if page is not None:
        try:
            fmt.check_page_size(page)
        except UnsupportedError:
            page = None
    align = fmt.token_alignment
    tile = draw(st.sampled_from([t for t in (16, 32, 64, 128) if t % align == 0]))
    return dict(fmt=fmt, Hkv=Hkv, G=G, lens=lens, page=page, csr=draw(st.booleans()), tile=tile,
                splits=draw(st.integers(1, 5)), k_mag=draw(st.sampled_from((1e-3, 1.0, 1e3))),
                v_mag=draw(st.sampled_from((1e-3, 1.0, 1e3))), offset=draw(st.sampled_from((0.0, 3.0))),
                const_frac=draw(st.sampled_from((0.0, 0.0, 0.25))), window_dtype=draw(st.sampled_from(
                    (torch.bfloat16, torch.float16))), quantizer=draw(st.sampled_from(("minmax", "mse"))),
                key_mean=draw(st.sampled_from((None, None, "prefill"))),
                seed=draw(st.integers(0, 2 ** 31)))


def build(case):
    """Inputs and cache of a case: pages shuffled through the pool, with spare pages."""
    fmt, Hkv, G, lens = case["fmt"], case["Hkv"], case["G"], case["lens"]
    gen = torch.Generator().manual_seed(case["seed"])
    B, L, D = len(lens), max(lens), fmt.head_dim
    k = random_values((B, Hkv, L, D), case["k_mag"], case["offset"], case["const_frac"], gen)
    v = random_values((B, Hkv, L, D), case["v_mag"], case["offset"], case["const_frac"], gen)
    # logits O(1): the query is scaled against K's magnitude (softmax conditioning is not under test)
    q = (torch.randn(B, Hkv * G, D, generator=gen, dtype=torch.float64) / case["k_mag"]).float()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(seq_lens=seq_lens, quantizer=case["quantizer"], window_dtype=case["window_dtype"],
              key_mean=case.get("key_mean"))
    page = case["page"]
    if page is not None:
        n_quant = fmt.split_length(seq_lens.long())[1]
        need = [-(-int(n) // page) for n in n_quant]
        pool = sum(need) + 3
        perm = torch.randperm(pool, generator=gen).to(torch.int32)
        chunks = list(torch.split(perm[: sum(need)], need))
        if case["csr"]:
            indptr = torch.tensor([0] + need, dtype=torch.int32).cumsum(0).to(torch.int32)
            table = foscar.PageTable.from_csr(indptr, perm[: sum(need)].contiguous())
        else:
            bt = torch.full((B, max(need + [1]) + 1), 10 ** 6, dtype=torch.int32)  # padding never read
            for b, c in enumerate(chunks):
                bt[b, : len(c)] = c
            table = foscar.PageTable.from_block_table(bt, torch.tensor(need, dtype=torch.int32))
        kw.update(page_size=page, page_table=table, num_pages=pool)
    try:
        return q, foscar.quantize_kv(k, v, fmt, **kw)
    except InvalidArgumentError as e:  # values an FP16 window cannot hold (large keys, rotated): refused by name,
        assume("windows hold" not in str(e))  # which is right; not a case of these tests
        raise


PAPER = dict(fmt=foscar.KVFormat(bits=2, head_dim=128, group_size=128), Hkv=2, G=4, lens=[1000, 77], page=64,
             csr=True, tile=64, splits=3, k_mag=1.0, v_mag=1.0, offset=0.0, const_frac=0.0,
             window_dtype=torch.bfloat16, quantizer="minmax", seed=1)
