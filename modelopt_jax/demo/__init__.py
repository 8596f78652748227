"""The embedded demo checkpoint: a real ModelOpt FP8 export shipped inside the package.

``qwen2-bytes-fp8`` is a 3.2M-parameter byte-level Qwen2 trained on Jane Austen's novels and
exported by NVIDIA ModelOpt 0.47.0 with ``FP8_DEFAULT_CFG`` (per-tensor static FP8; lm_head and
embeddings in bf16), with its byte-level ``tokenizer.json``. It lets ``python -m modelopt_jax``
run with no download.
"""

from __future__ import annotations

import os

DEMO_NAME = "qwen2-bytes-fp8"


def demo_checkpoint_path() -> str:
    """Absolute path of the embedded demo checkpoint directory."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_NAME)
