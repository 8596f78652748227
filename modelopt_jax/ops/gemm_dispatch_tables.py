"""Measured GEMM dispatch tables (see :mod:`.gemm_dispatch`), written by ``bench/tune_dispatch.py --write``.

``TABLES[device_kind]``: ``"measured"`` (where, when, how) and ``"shapes"``: ``{(N, K): ((largest M,
path), ...)}``. Only shapes where a path other than our kernel measured faster carry entries.
"""

TABLES: dict = {}
