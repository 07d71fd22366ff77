"""Triton decode kernels (any CUDA GPU): the tunable baseline and fallback. They read the cache layout
of :mod:`foscar.format` (``docs/layout.md``) and implement :func:`foscar.decode_folded`. Not written yet
(issue 3); nothing here is imported by the rest of foscar until then."""
