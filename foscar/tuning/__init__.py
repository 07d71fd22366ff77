"""The tuned launch configurations shipped with foscar: ``<GPU>.json`` files (schema
:data:`foscar.autotune.SCHEMA`), package data read through :mod:`importlib.resources` by
:func:`foscar.autotune.lookup` after ``$FOSCAR_TUNING_DIR`` and the user cache folder. Made on the GPU
they are for with ``foscar tune --out foscar/tuning`` (``tuning/README.md``)."""
