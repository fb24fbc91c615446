"""The folder tree is the layer list: imports point down only, no import cycles, private names stay
in their module, and a module with ``__all__`` is used only through it. Lazy imports inside functions
count the same as imports at the top."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Highest first; a module may import its own layer and the layers below it. A tuple holds peer layers,
# which import neither each other nor the layers above them. "api" is the package root: it re-exports
# the public API from every layer, so nothing inside memfit imports it.
LAYERS = ["api", "testing", "cli", ("serve", "batch"), "run", "models", "plan", "quant", "compile", "cache", "base"]
BASE = {"memfit.errors", "memfit.devices", "memfit.sizes", "memfit.dtypes", "memfit.atomic",
        "memfit.safetensors_header", "memfit.demo", "memfit.demo.shapes", "memfit.text_enum",
        "memfit.version"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "memfit").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    if module == "memfit":
        return "api"
    if module in BASE:
        return "base"
    if module == "memfit.__main__":
        return "cli"
    return module.split(".")[1]


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(imported memfit module, names taken from it) for every import statement in ``module``."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("memfit")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfit") and not node.level:
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{name}" for name in names if f"{node.module}.{name}" in MODULES]
            found += [(sub, []) for sub in submodules]
            names = [name for name in names if f"{node.module}.{name}" not in MODULES]
            if names or not submodules:
                found.append((node.module, names))
    return found


def _rank(layer: str) -> int:
    """A layer's place in LAYERS (peer layers share one); -1 for a layer not in the list."""
    return next((i for i, entry in enumerate(LAYERS) if layer == entry or (isinstance(entry, tuple) and layer in entry)),
                -1)


def test_every_module_is_in_a_known_layer():
    unknown = sorted(m for m in MODULES if _rank(_layer(m)) < 0)
    assert not unknown, f"modules outside the layer list {LAYERS}: {unknown}"


def _public_names(module: str) -> list[str] | None:
    """``module``'s ``__all__`` (a literal list), or None where it has none."""
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return ast.literal_eval(node.value)
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def test_imports_point_down_the_layers():
    upward = []
    for module in MODULES:
        for imported, _ in _imports(module):
            above, peer = _rank(_layer(imported)), _layer(imported) != _layer(module)
            if above < _rank(_layer(module)) or (above == _rank(_layer(module)) and peer):
                upward.append(f"{module} -> {imported}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_private_name_crosses_a_module_boundary():
    crossing = [f"{module} imports {name} from {imported}" for module in MODULES for imported, names in _imports(module)
                for name in names if _is_private(name) and imported != module]
    assert not crossing, "\n".join(crossing)


# Names that modules being rewritten (run/generate.py, run/stages.py) are to add to their __all__.
def test_a_module_with_all_is_used_through_it():
    # A name left out of a module's __all__ is not meant for other modules: import it from where it
    # belongs, or add it to __all__ if it is meant to be used elsewhere.
    outside = []
    for module in MODULES:
        for imported, names in _imports(module):
            public = _public_names(imported) if imported in MODULES and imported != module else None
            if public is not None:
                outside += [f"{module} imports {name} from {imported}, which leaves it out of __all__" for name in names
                            if name not in public]
    assert not outside, "\n".join(outside)


def test_no_import_cycles():
    graph = {module: {imported for imported, _ in _imports(module) if imported in MODULES} for module in MODULES}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if state.get(nxt) != 2:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _fake_module(tmp_path, monkeypatch, source: str) -> None:
    fake = tmp_path / "memfit" / "run" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "memfit.run.fake", fake)


def test_the_checker_sees_a_private_import(tmp_path, monkeypatch):
    # The checks must be able to fail: a module taking a private name from another is caught.
    _fake_module(tmp_path, monkeypatch, "from memfit.plan.meta import _private_helper\n")
    with pytest.raises(AssertionError, match="_private_helper"):
        test_no_private_name_crosses_a_module_boundary()


def test_the_checker_sees_a_name_left_out_of_all(tmp_path, monkeypatch):
    _fake_module(tmp_path, monkeypatch, "from memfit.plan.meta import measure_component\n\n\ndef f():\n"
                                        "    from memfit.plan.meta import helper_left_out\n")
    with pytest.raises(AssertionError, match="memfit.run.fake imports helper_left_out from memfit.plan.meta") as info:
        test_a_module_with_all_is_used_through_it()
    assert "measure_component" not in str(info.value)


def test_the_checker_sees_an_import_of_the_package_root(tmp_path, monkeypatch):
    _fake_module(tmp_path, monkeypatch, "from memfit import Budget\n")
    with pytest.raises(AssertionError, match=r"memfit\.run\.fake -> memfit\n"):
        test_imports_point_down_the_layers()
