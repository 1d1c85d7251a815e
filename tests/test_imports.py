"""The package layers: every module imports only modules of its own layer or a lower one,
so the model (`layers/`) knows nothing of the engine and no two rooms import each other."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# lowest first; a module belongs to the layer of its longest matching prefix ("engine"
# itself is only the package's __init__)
LAYERS = (
    ("collectives",),
    ("layers",),
    ("engine", "engine.config", "engine.text"),
    ("engine.parallel",),
    ("engine.run",),
    ("engine.cost", "engine.hf"),
    ("engine.planner",),
    ("engine.cli", "engine.train", "engine.generate", "engine.plan", "engine.launch",
     "engine.prepare", "engine.convert"),
)
PACKAGES = ("collectives", "layers", "engine")


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s longest matching prefix."""
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != "engine"
            if (module == prefix or inside) and len(prefix) > best:
                best, found = len(prefix), i
    if found is None:
        raise KeyError(f"{module} is in no layer of tests/test_imports.py LAYERS")
    return found


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path) -> set[str]:
    """Every first-party module `path` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in PACKAGES}


def resolve(name: str) -> str:
    """`name` as a module: `engine.run.step.Trainer` -> `engine.run.step`."""
    while name and not ((ROOT / name.replace(".", "/")).with_suffix(".py").exists()
                        or (ROOT / name.replace(".", "/") / "__init__.py").exists()):
        name = name.rpartition(".")[0]
    return name


MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path):
    me = module_name(path)
    upward = sorted(f"{dep} (layer {layer_of(dep)})" for dep in map(resolve, imported(path))
                    if layer_of(dep) > layer_of(me))
    assert not upward, f"{me} (layer {layer_of(me)}) imports {upward}"


def test_an_upward_import_is_caught(tmp_path):
    # a lazy import inside a function counts, and a name imported from a module resolves
    # to the module: the model importing the engine is what the layers forbid
    src = tmp_path / "mod.py"
    src.write_text("import collectives\n\ndef f():\n    from engine.run.step import Trainer\n")
    deps = {resolve(name) for name in imported(src)}
    assert deps == {"collectives", "engine.run.step"}
    assert max(map(layer_of, deps)) > layer_of("layers.axes")
