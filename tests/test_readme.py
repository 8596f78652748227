"""Every Python snippet in README.md runs as written (on the embedded demo, on this machine's CPU).

Each ```python block is extracted and run in a fresh interpreter (as a user pastes it), with two
host devices so the tensor-parallel snippet has its mesh. A README edit that breaks a snippet, or
an API change that a snippet no longer matches, fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _snippets() -> list[tuple[int, str]]:
    with open(README) as f:
        text = f.read()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        out.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return out


SNIPPETS = _snippets()


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("line,code", SNIPPETS, ids=[f"README.md:{line}" for line, _ in SNIPPETS])
def test_readme_snippet_runs_as_written(line, code, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               MODELOPT_JAX_WEIGHT_CACHE_DIR=str(tmp_path / "wc"))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"README.md:{line} failed:\n{code}\n--- stderr ---\n{run.stderr[-4000:]}"
