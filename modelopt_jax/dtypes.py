"""The package's one table of dtype names: compute dtypes and KV-cache dtypes.

``load``, ``LLM``, the weight-cache daemon and the CLI all accept the same spellings and reject
others with the same :class:`ConfigError`, so a name that works in one place works everywhere.
"""

from __future__ import annotations

import jax.numpy as jnp

from modelopt_jax.errors import ConfigError

# Compute (and activation) dtypes. FP8 weights stay FP8 whatever is chosen here.
COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
# Spellings of an FP8 e4m3 KV cache (vLLM accepts "fp8" and "fp8_e4m3").
FP8_KV_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
# What ``kv_cache_dtype`` accepts: "auto" follows the checkpoint (FP8 when it has k/v scales).
KV_CACHE_DTYPES = ("auto", *FP8_KV_NAMES, *COMPUTE_DTYPES)


def compute_dtype(dtype, *, argument: str = "dtype") -> jnp.dtype:
    """``dtype`` (a name or a numpy/jax dtype) as a jnp.dtype; ConfigError naming ``argument`` otherwise."""
    choices = ", ".join(COMPUTE_DTYPES)
    if isinstance(dtype, str):
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"{argument}={dtype!r} not supported; choose one of {choices}")
        return jnp.dtype(COMPUTE_DTYPES[dtype])
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"{argument}={dtype!r} is not a dtype; choose one of {choices}") from e
    if d not in [jnp.dtype(v) for v in COMPUTE_DTYPES.values()]:
        raise ConfigError(f"{argument}={d} not supported; choose one of {choices}")
    return d


def kv_cache_dtype_name(value) -> str:
    """The canonical KV-cache dtype name: "auto", "fp8" or a compute dtype name."""
    name = str(value).lower()
    if name in FP8_KV_NAMES:
        return "fp8"
    if name == "auto" or name in COMPUTE_DTYPES:
        return name
    raise ConfigError(f"kv_cache_dtype={value!r} not supported; choose one of "
                      f"{', '.join(repr(n) for n in ('auto', 'fp8', *COMPUTE_DTYPES))}")
