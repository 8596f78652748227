"""ModelOpt's quantization settings: where they live, whether they agree, what they exclude.

A ModelOpt export describes its quantization in ``hf_quant_config.json`` (legacy) and/or in
``config.json`` as ``quantization_config`` with ``quant_method: modelopt``. When both exist they
must say the same thing; we refuse to guess which one is right.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any

from modelopt_jax.checkpoint.hf_config import CONFIG_FILE, read_json
from modelopt_jax.errors import ConfigError, UnsupportedQuantizationError

HF_QUANT_FILE = "hf_quant_config.json"

SUPPORTED_QUANT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
SUPPORTED_KV_ALGOS = ("FP8",)
# Known ModelOpt formats that we recognise but do not run (named in the error message).
KNOWN_UNSUPPORTED = ("NVFP4", "W4A16_NVFP4", "W4A8_NVFP4_FP8", "MXFP8", "MIXED_PRECISION", "INT8_SQ",
                     "W4A16_AWQ", "W4A8_AWQ", "INT4_AWQ", "NVFP4_AWQ")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What ModelOpt did to the checkpoint. ``quant_algo is None`` means an unquantized checkpoint."""

    quant_algo: str | None
    kv_cache_quant_algo: str | None
    exclude_modules: tuple[str, ...]
    producer: str | None = None
    producer_version: str | None = None
    sources: tuple[str, ...] = ()  # files the settings came from

    @property
    def is_quantized(self) -> bool:
        return self.quant_algo is not None

    def exclusion_rule(self, module: str) -> str | None:
        """The pattern (and rule) that excludes ``module`` from quantization, or None."""
        for pattern in self.exclude_modules:
            rule = match_exclusion(module, pattern)
            if rule:
                return f"{pattern!r} ({rule})"
        return None

    def is_excluded(self, module: str) -> bool:
        return self.exclusion_rule(module) is not None


def match_exclusion(module: str, pattern: str) -> str | None:
    """How ``pattern`` matches module path ``module``: "exact", "wildcard", "substring" or None.

    ``path*`` also covers ``path`` itself and ``path.*`` (fnmatch already does, since ``*`` may be
    empty). The substring rule is what older ModelOpt/vLLM versions used for plain names like
    ``lm_head``; it is kept for compatibility and reported as such by ``inspect``.
    """
    if module == pattern:
        return "exact"
    if any(c in pattern for c in "*?["):
        if fnmatch.fnmatchcase(module, pattern):
            return "wildcard"
        if pattern.endswith("*") and (module == pattern.rstrip("*").rstrip(".")):
            return "wildcard"
        return None
    if pattern and pattern in module:
        return "substring"
    return None


def _upper_or_none(value: Any, field: str, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{path}: {field} must be a string or null, found {value!r}")
    return value.upper()


def _exclusions(value: Any, field: str, path: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {field} must be a list of strings, found {value!r}")
    return tuple(value)


def _from_hf_quant_config(raw: dict[str, Any], path: str) -> QuantConfig:
    quant = raw.get("quantization")
    if not isinstance(quant, dict):
        raise ConfigError(f"{path}: missing the 'quantization' object")
    if "quant_algo" not in quant:
        raise ConfigError(f"{path}: 'quantization' has no quant_algo")
    producer = raw.get("producer") or {}
    return QuantConfig(
        quant_algo=_upper_or_none(quant.get("quant_algo"), "quant_algo", path),
        kv_cache_quant_algo=_upper_or_none(quant.get("kv_cache_quant_algo"), "kv_cache_quant_algo", path),
        exclude_modules=_exclusions(quant.get("exclude_modules"), "exclude_modules", path),
        producer=producer.get("name") if isinstance(producer, dict) else None,
        producer_version=producer.get("version") if isinstance(producer, dict) else None,
        sources=(path,))


def _kv_from_scheme(qc: dict[str, Any], path: str) -> str | None:
    if "kv_cache_quant_algo" in qc:
        return _upper_or_none(qc["kv_cache_quant_algo"], "kv_cache_quant_algo", path)
    scheme = qc.get("kv_cache_scheme")
    if scheme is None:
        return None
    if not isinstance(scheme, dict):
        raise ConfigError(f"{path}: quantization_config.kv_cache_scheme must be an object, found {scheme!r}")
    if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
        return "FP8"
    return f"{scheme.get('type')}{scheme.get('num_bits')}".upper()


def _from_config_json(qc: dict[str, Any], path: str) -> QuantConfig:
    if "quant_algo" not in qc:
        raise ConfigError(f"{path}: quantization_config has no quant_algo")
    producer = qc.get("producer") or {}
    return QuantConfig(
        quant_algo=_upper_or_none(qc.get("quant_algo"), "quantization_config.quant_algo", path),
        kv_cache_quant_algo=_kv_from_scheme(qc, path),
        exclude_modules=_exclusions(qc.get("ignore", qc.get("exclude_modules")), "quantization_config.ignore", path),
        producer=producer.get("name") if isinstance(producer, dict) else None,
        producer_version=producer.get("version") if isinstance(producer, dict) else None,
        sources=(path,))


def check_supported(qc: QuantConfig) -> None:
    where = " and ".join(qc.sources)
    if qc.quant_algo is not None and qc.quant_algo not in SUPPORTED_QUANT_ALGOS:
        kind = "a ModelOpt format this package does not run" if qc.quant_algo in KNOWN_UNSUPPORTED else "unknown"
        raise UnsupportedQuantizationError(
            f"{where}: quant_algo {qc.quant_algo!r} is {kind}; supported: {', '.join(SUPPORTED_QUANT_ALGOS)}")
    if qc.kv_cache_quant_algo is not None and qc.kv_cache_quant_algo not in SUPPORTED_KV_ALGOS:
        raise UnsupportedQuantizationError(
            f"{where}: kv_cache_quant_algo {qc.kv_cache_quant_algo!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_KV_ALGOS)} or none")


def load_quant_config(directory: str, config_json: dict[str, Any] | None = None,
                      check: bool = True) -> QuantConfig:
    """Reads and reconciles both places ModelOpt may have written its settings.

    Raises ConfigError when the two disagree or when config.json declares another quant_method,
    UnsupportedQuantizationError (if ``check``) for algorithms we do not run.
    """
    config_path = os.path.join(directory, CONFIG_FILE)
    hf_path = os.path.join(directory, HF_QUANT_FILE)
    if config_json is None:
        config_json = read_json(config_path)
    found: list[QuantConfig] = []
    if os.path.exists(hf_path):
        found.append(_from_hf_quant_config(read_json(hf_path), hf_path))
    qc = config_json.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise ConfigError(f"{config_path}: quantization_config must be an object")
        method = qc.get("quant_method")
        if method != "modelopt":
            raise UnsupportedQuantizationError(
                f"{config_path}: quantization_config.quant_method is {method!r}; this package reads "
                f"ModelOpt checkpoints (quant_method 'modelopt')")
        found.append(_from_config_json(qc, config_path))
    if not found:
        result = QuantConfig(None, None, ())
    elif len(found) == 1:
        result = found[0]
    else:
        a, b = found
        diffs = [f"{field}: {getattr(a, field)!r} in {HF_QUANT_FILE} vs {getattr(b, field)!r} in {CONFIG_FILE}"
                 for field in ("quant_algo", "kv_cache_quant_algo") if getattr(a, field) != getattr(b, field)]
        if set(a.exclude_modules) != set(b.exclude_modules):
            diffs.append(f"exclude_modules {sorted(a.exclude_modules)} in {HF_QUANT_FILE} vs "
                         f"ignore {sorted(b.exclude_modules)} in {CONFIG_FILE}")
        if diffs:
            raise ConfigError(f"{hf_path} and {config_path} disagree: " + "; ".join(diffs))
        result = dataclasses.replace(a, sources=(hf_path, config_path),
                                     producer=a.producer or b.producer,
                                     producer_version=a.producer_version or b.producer_version)
    if check:
        check_supported(result)
    return result
