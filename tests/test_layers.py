"""The package's layers, read from its own imports: each module imports only from layers below its own (or from
its own subpackage), and no subpackage reaches into another's modules past its __init__."""
from __future__ import annotations

import ast
from pathlib import Path

import batchrun

PACKAGE = Path(batchrun.__file__).parent
# Top to bottom. A module may import from its own layer's package and from any layer below it.
LAYERS = ["cli", "api", "distributed", "job", "report", "output", "store", "measure", "runtime", "plan", "checkpoint",
          "spec", "quality", "host", "errors"]
# Submodules other layers use as namespaces: fault points (`faults.reached("commit")`), and the CPU kernels that
# measuring times, imported beside torch inside the functions that measure.
NAMESPACES = {"batchrun.host.faults", "batchrun.runtime.linear_kernels"}


def layer_of(module: str) -> str:
    """'batchrun.plan.memory' -> 'plan'; 'batchrun.cli' -> 'cli'; 'batchrun' (the public API) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> list[tuple[str, str]]:
    """(module imported, name or '') for every batchrun import in the file, top level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "batchrun":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "batchrun"]
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("batchrun",) + path.relative_to(PACKAGE).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def test_every_module_belongs_to_a_layer():
    unknown = {layer_of(name) for name, _ in modules()} - set(LAYERS) - {"", "__main__"}
    assert not unknown, f"modules outside the declared layers: {unknown}"


def test_imports_run_down_the_layers_only():
    against = []
    for name, path in modules():
        own = layer_of(name)
        if own in ("", "__main__"):
            continue  # the public API and `python -m batchrun` sit above every layer
        for module, imported in imports_of(path):
            target = layer_of(module) if module != "batchrun" else layer_of(f"batchrun.{imported}")
            if target and target != own and LAYERS.index(target) < LAYERS.index(own):
                against.append(f"{name} imports {module} {imported}".strip())
    assert not against, "imports against the layers:\n" + "\n".join(against)


def test_subpackages_are_reached_through_their_init_only():
    reached = []
    for name, path in modules():
        own = layer_of(name)
        for module, imported in imports_of(path):
            parts = module.split(".")
            if len(parts) == 2 and (PACKAGE / parts[1] / f"{imported}.py").exists():
                module, parts = f"{module}.{imported}", parts + [imported]  # `from batchrun.host import faults`
            if len(parts) > 2 and parts[1] != own and module not in NAMESPACES:
                reached.append(f"{name} imports {module}")
    assert not reached, "imports past another subpackage's __init__:\n" + "\n".join(reached)
