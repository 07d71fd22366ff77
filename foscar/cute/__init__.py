"""CuTe DSL kernels (Hopper sm_90a, Blackwell sm_100a): the fast path (issue 4). They read the cache
layout of :mod:`foscar.format` (``docs/layout.md``) and implement :func:`foscar.decode_folded`.

So far: :mod:`foscar.cute.fragment`, the register fragment of Hopper ``wgmma`` with A from registers and
where each thread finds its codes in a packed tile, checked against CuTe DSL's own tiled MMA
(``tests/test_cute_fragment.py``). The decode kernel is not written yet; nothing here is imported by
the rest of foscar, and importing this package does not import cutlass.
"""
