"""CuTe DSL kernels (Hopper sm_90a, Blackwell sm_100a): the fast path. They read the cache layout of
:mod:`foscar.format` (``docs/layout.md``) and implement :func:`foscar.decode_folded`. Not written yet
(issue 4); nothing here is imported by the rest of foscar until then."""
