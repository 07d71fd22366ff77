"""CuTe DSL kernels for Hopper (sm_90a). They read the cache layout of :mod:`foscar.format`
(``docs/layout.md``) and implement :func:`foscar.decode_folded`. Importing this package does not import
cutlass.

One module per role:

- :mod:`~foscar.cute.config`: the static configuration (:class:`~foscar.cute.config.Sm90Config`,
  :func:`~foscar.cute.config.config_for`) and the constants the host side reads;
- :mod:`~foscar.cute.fragment`: where each thread finds the codes of its wgmma A registers (the index
  functions the kernels trace), and CuTe's fragment ownership for the tests;
- :mod:`~foscar.cute.operands`: the tiled MMAs, Q^T in shared memory, the K and V^T A registers;
  :mod:`~foscar.cute.operands_e4m3`: E4M3 K operands and Q's terms; :mod:`~foscar.cute.operands_fp4`: the FP4
  operands (E2M1 codes placed as FP16 times their block scales; MXFP4's relative to each token's largest), :mod:`~foscar.cute.config_fp4` what the kernel
  takes of the FP4 formats;
- :mod:`~foscar.cute.softmax`: the online softmax; :mod:`~foscar.cute.folds`: the acc-folds, the
  operand-folds and the offset corrections;
- :mod:`~foscar.cute.warpgroup`: a computing warpgroup's state and the tile step both kernels share;
- :mod:`~foscar.cute.kernel_v0` and :mod:`~foscar.cute.kernel_v1`: the two kernels;
- :mod:`~foscar.cute.compile`: :func:`~foscar.cute.compile.compile_stage1`; :mod:`~foscar.cute.compile_cache`:
  its disk cache; :mod:`~foscar.cute.launch`: validation, launch configs and the decode call;
- :mod:`~foscar.cute.decode_sm90`: the names the rest of foscar imports.
"""
