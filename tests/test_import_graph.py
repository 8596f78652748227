"""The package's modules import downhill: no module reaches (directly or through others) back to itself.

Every ``import``/``from ... import`` in every module counts, including the ones inside functions
(a lazy import still makes two modules depend on each other). ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg`` itself; a package's ``__init__`` is a
node of its own (the public aggregator), and a module importing its own top-level package would
show up as a cycle through it.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "modelopt_jax"


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {}
    roots = [(root / PACKAGE, PACKAGE), (root / "models", f"{PACKAGE}.models")]  # models/ installs as .models
    for base, prefix in roots:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if sub in modules else module)
    return {m for m in out if m in modules and m != name}


def import_problems(root: pathlib.Path) -> tuple[dict, list[list[str]]]:
    """(graph, cycles) of the package under ``root``. The public aggregator ``modelopt_jax/__init__.py``
    imports nearly everything, so a module that imports it (e.g. for ``__version__``) closes a cycle."""
    modules = _modules(root)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return graph, cycles


def test_no_import_cycles():
    graph, cycles = import_problems(ROOT)
    assert f"{PACKAGE}.pipeline" in graph and f"{PACKAGE}.models.llama" in graph
    assert f"{PACKAGE}.pipeline" in graph[f"{PACKAGE}.loader"], "the scan found no imports"
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Layering beyond "no cycles". The server is the top layer: only the CLI imports it, so the library
# (and `import modelopt_jax`) never needs its packages. The optional packages stay in the one place
# that needs them: the web stack in the server's HTTP modules (its protocol, engine thread and
# response shapes are plain Python), jinja2 in the chat-template module.
ONLY_IMPORTED_BY = {f"{PACKAGE}.serve": {f"{PACKAGE}.__main__"}}
OPTIONAL_PACKAGES = {"starlette": {f"{PACKAGE}.serve.app"}, "fastapi": set(),
                     "uvicorn": {f"{PACKAGE}.serve.server"}, "jinja2": {f"{PACKAGE}.chat_template"},
                     "zmq": {f"{PACKAGE}.serve.core", f"{PACKAGE}.serve.core_client"},
                     "msgspec": {f"{PACKAGE}.serve.core_protocol"},
                     "prometheus_client": {f"{PACKAGE}.serve.metrics"}}


def _external_imports(path: pathlib.Path) -> set[str]:
    """Top-level names of the absolute imports in ``path`` (lazy ones inside functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def layering_problems(root: pathlib.Path) -> list[str]:
    modules = _modules(root)
    graph, _ = import_problems(root)
    problems = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            for layer, allowed in ONLY_IMPORTED_BY.items():
                inside = name == layer or name.startswith(layer + ".")
                if (dep == layer or dep.startswith(layer + ".")) and not inside and name not in allowed:
                    problems.append(f"{name} imports {dep} (only {sorted(allowed)} may)")
        for package in sorted(_external_imports(modules[name]) & set(OPTIONAL_PACKAGES)):
            if name not in OPTIONAL_PACKAGES[package]:
                problems.append(f"{name} imports {package} (only {sorted(OPTIONAL_PACKAGES[package])} may)")
    return problems


def test_layers_and_optional_packages():
    graph, _ = import_problems(ROOT)
    assert f"{PACKAGE}.serve.app" in graph and f"{PACKAGE}.chat_template" in graph[f"{PACKAGE}.llm"]
    assert not layering_problems(ROOT), "\n".join(layering_problems(ROOT))


def test_the_layering_check_detects_violations(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "serve").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "serve" / "__init__.py").write_text("")
    (pkg / "serve" / "engine_thread.py").write_text("import starlette.requests\n")   # web stack off its module
    (pkg / "llm.py").write_text("def f():\n    from modelopt_jax.serve import engine_thread\n")  # upward
    (pkg / "__main__.py").write_text("from modelopt_jax.serve import engine_thread\n")  # allowed
    (tmp_path / "models").mkdir()
    assert layering_problems(tmp_path) == [
        "modelopt_jax.llm imports modelopt_jax.serve.engine_thread (only ['modelopt_jax.__main__'] may)",
        "modelopt_jax.serve.engine_thread imports starlette (only ['modelopt_jax.serve.app'] may)"]


def test_the_scan_detects_a_cycle(tmp_path):
    """The checker itself: two modules importing each other (one lazily) are reported."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from modelopt_jax.c import g\n")
    (pkg / "a.py").write_text("def f():\n    from modelopt_jax import b\n")
    (pkg / "b.py").write_text("from modelopt_jax.a import f\n")
    (pkg / "c.py").write_text("from modelopt_jax import __version__\n")  # back through the aggregator
    (tmp_path / "models").mkdir()
    _, cycles = import_problems(tmp_path)
    assert sorted(" -> ".join(c) for c in cycles) == ["modelopt_jax -> modelopt_jax.c -> modelopt_jax",
                                                      "modelopt_jax.a -> modelopt_jax.b -> modelopt_jax.a"]
