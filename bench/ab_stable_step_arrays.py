"""An A/B harness for bench/serve.py (GPU; not a test): the same run with each step's int32 arrays
first copied into program temporaries.

Why: XLA re-records a command buffer's commands whenever an allocation they read has moved since the
last run, and re-captures traced FFI commands (our attention and GEMM handlers) for address
combinations its small per-command cache has not seen. A step's input arrays are new device buffers
every step, and every layer's attention reads them; copied first (a fusion the simplifier cannot
drop), the commands read temporaries, whose addresses repeat from run to run. If this run's host time
per step (``--host-breakdown``) falls against serve.py's own, the runner should build its steps this way.

    python bench/ab_stable_step_arrays.py SERVE_PY_ARGS...   (e.g. --checkpoint DIR --workloads c
                                                               --no-precompile --host-breakdown c1024)
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from modelopt_jax.engine import runner as runner_module  # noqa: E402

_BIG = 2**31 - 2  # above every index a step holds: min() with it changes no value
_original_step_fn = runner_module.Runner._step_fn


def _temporary(a):
    return a if not hasattr(a, "dtype") or a.dtype != jnp.int32 else jnp.minimum(a, _BIG)


def _step_fn_on_temporaries(self, program, weights, cache, step, rows, last_tokens):
    copied = {f.name: _temporary(getattr(step, f.name)) for f in dataclasses.fields(step)
              if f.name not in ("num_decode", "attention") and getattr(step, f.name) is not None}
    return _original_step_fn(self, program, weights, cache, dataclasses.replace(step, **copied), rows, last_tokens)


if __name__ == "__main__":
    runner_module.Runner._step_fn = _step_fn_on_temporaries
    import serve

    serve.main()
