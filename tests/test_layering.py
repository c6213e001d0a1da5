"""The package's layers, kept: every import read with `ast`, no layer importing one above it, no circles.

The layers, lowest first (README and docs/layout.md draw them): the package root (errors.py, files.py,
after_exit.py), model/,
kernels/, checkpoint/, parallel/, text/ and sampling/, generation/ and engine/ (siblings), server/, cli/, and the
entry points (generate.py, chat.py, serve.py at the root, which only hand over to cli/). A module may
import its own layer and the layers ALLOWED lists for it. Imports inside functions count too: a lazy
import is still a dependency. scripts/ import the package freely, but not each other in a circle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qwen3_scratch"
SCRIPTS = ROOT / "scripts"

ENTRY_POINTS = {"generate", "chat", "serve"}  # qwen3_scratch/<name>.py: `python -m qwen3_scratch.<name>`
ALLOWED = {
    "root": set(),
    "model": {"root"},
    "kernels": {"root", "model"},
    "checkpoint": {"root", "model", "kernels"},
    "text": {"root"},
    "sampling": {"root"},
    "parallel": {"root", "model", "kernels", "checkpoint"},
    "generation": {"root", "model", "kernels", "checkpoint", "parallel", "text", "sampling"},
    "engine": {"root", "model", "kernels", "checkpoint", "parallel", "text", "sampling"},
    "server": {"root", "engine", "text", "sampling"},
    "cli": {"root", "model", "kernels", "checkpoint", "parallel", "text", "sampling", "generation", "engine", "server"},
    "entry": {"cli"},
}


def module_name(path: Path, base: Path, prefix: str) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts]) if prefix else ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p, PACKAGE, "qwen3_scratch"): p for p in PACKAGE.rglob("*.py")}


def script_paths() -> list[Path]:
    return sorted(SCRIPTS.rglob("*.py"))


def script_modules() -> dict[str, Path]:
    """{module name: path}: scripts import each other by bare name, whatever folder of scripts/ holds them."""
    return {p.stem: p for p in script_paths()}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that `path` (module `name`) imports anywhere in its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1 more
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # `from pkg import mod` names a module when pkg.mod is one; otherwise it imports from pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` depends on a.b.c, or the closest module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("errors", "files", "after_exit"):
        return "root"
    if len(parts) == 2 and parts[1] in ENTRY_POINTS:
        return "entry"
    return parts[1]


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import from a layer into one it may not use, as 'a -> b (layer x may not import layer y)'."""
    problems = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            a, b = layer_of(source), layer_of(target)
            if a != b and b not in ALLOWED[a]:
                problems.append(f"{source} -> {target} (layer {a} may not import layer {b})")
    return problems


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None: a depth-first search for a back edge."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_the_checker_finds_an_upward_import_and_a_circle():
    """The checks below must be able to fail: an engine import inside the model, and a two-module circle."""
    upward = {"qwen3_scratch.model.qwen3": {"qwen3_scratch.engine.engine"}}
    assert layer_violations(upward) == [
        "qwen3_scratch.model.qwen3 -> qwen3_scratch.engine.engine (layer model may not import layer engine)"
    ]
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(circle) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # relative imports resolve as Python resolves them
    source = PACKAGE / "engine" / "engine.py"
    assert "qwen3_scratch.engine.scheduler" in imports_of("qwen3_scratch.engine.engine", source, set(package_modules()))


def test_the_allowed_layers_themselves_form_no_circle():
    edges = {layer: set(allowed) for layer, allowed in ALLOWED.items()}
    assert find_cycle(edges) is None, f"the layer table has a circle: {find_cycle(edges)}"


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted(m for m in package_modules() if layer_of(m) not in ALLOWED)
    assert not unknown, f"modules outside every layer (add the folder to ALLOWED, and to docs/layout.md): {unknown}"


def test_no_layer_imports_one_above_it():
    problems = layer_violations(package_graph())
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_the_package_has_no_import_circle():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_scripts_have_no_import_circle():
    scripts = script_modules()
    edges = {name: imports_of(name, path, set(scripts)) for name, path in scripts.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import circle in scripts/: " + " -> ".join(cycle)


def test_no_two_scripts_share_a_module_name():
    """Every folder of scripts/ is on one sys.path (tests/conftest.py): two files of one name would shadow each other."""
    by_name: dict[str, list[str]] = {}
    for path in script_paths():
        by_name.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"scripts with the same module name (rename one): {clashes}"


def test_only_the_entry_points_run_as_main_and_nothing_imports_them():
    """A library module is never also `__main__`: that is what made generate.py and chat.py a circle."""
    mains = sorted(name for name, path in package_modules().items() if '__name__ == "__main__"' in path.read_text())
    assert mains == sorted(f"qwen3_scratch.{entry}" for entry in ENTRY_POINTS), mains
    importers = [source for source, targets in package_graph().items() for t in targets if layer_of(t) == "entry"]
    assert not importers, f"entry points are not libraries, yet imported by {importers}"
