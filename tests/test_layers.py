"""The package's layers, read from its own imports: each module imports only from layers below its own (or from
its own subpackage), and no subpackage reaches into another's modules past its __init__."""
from __future__ import annotations

import ast
import io
import re
import tokenize
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


def reached_past_init(path: Path, own: str) -> list[str]:
    """The modules of other subpackages than `own` that the file imports past their __init__ (NAMESPACES aside)."""
    reached = []
    for module, imported in imports_of(path):
        parts = module.split(".")
        if len(parts) == 2 and (PACKAGE / parts[1] / f"{imported}.py").exists():
            module, parts = f"{module}.{imported}", parts + [imported]  # `from batchrun.host import faults`
        if len(parts) > 2 and parts[1] != own and module not in NAMESPACES:
            reached.append(module)
    return reached


def test_subpackages_are_reached_through_their_init_only():
    reached = [f"{name} imports {module}" for name, path in modules()
               for module in reached_past_init(path, layer_of(name))]
    assert not reached, "imports past another subpackage's __init__:\n" + "\n".join(reached)


# Test files that still reach a module of another subpackage, each for a name that is no public one: the
# measurements cache a test plants a disturbed figure in (and the measuring kernels' internals), the decode step the
# reference runs, and the prefill's shared prefix that the shared helpers hook.
REACHES_LEFT = {
    "tests/job/test_execute_options.py": {"batchrun.measure.cache"},
    "tests/runtime/test_linear_kernels.py": {"batchrun.measure.cache", "batchrun.measure.compute"},
    "tests/reference.py": {"batchrun.runtime.decode"},
    "tests/support.py": {"batchrun.runtime.prefill"},
}


def test_tests_reach_subpackages_through_their_init_only():
    # A test is held to the package's own rule: tests/plan/ tests batchrun/plan/ and may import its modules, as they
    # import each other; any other subpackage it reaches by the names its __init__ exports. A monkeypatch target
    # named as a string is no import.
    tests = Path(__file__).parent
    reached = []
    for path in sorted(tests.rglob("*.py")):
        folders, name = path.relative_to(tests).parts[:-1], str(path.relative_to(tests.parent))
        reached += [f"{name} imports {module}" for module in reached_past_init(path, folders[0] if folders else "")
                    if module not in REACHES_LEFT.get(name, ())]
    assert not reached, "tests importing past a subpackage's __init__:\n" + "\n".join(reached)


# Comments and docstrings state a rule and its why; the figures behind it (timings, rates, the machine and the model
# they came from) live in docs/performance.md, where they can be dated and rerun. These are how such figures read.
MEASURED_FIGURE = re.compile(
    r"(?<![\w\"'.,/])\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|s|min|[KMGT]i?B/s|[GT]FLOP/s)(?![\w/])"  # a time or a rate
    r"|\bMeasured (?:on|with|here|before|at)\b|\bmeasured (?:on (?:a|an|the|\d)|here|with and without)\b"  # where, how
    r"|\bpeak RSS (?:of )?~?\d|\d (?:[KMG]i?B) (?:measured|peak)\b"  # a measured memory peak
    r"|\d\s?(?:[KMG]i?B|%)\s(?:against|vs\.?)\s~?\d"  # a before/after pair of sizes
    r"|\b(?:EPYC|Xeon|Ryzen|Threadripper|Graviton|Neoverse)\b"  # the machine a figure came from
    r"|\d(?:\.\d+)? ?GB (?:\w+ )?(?:Llama|model|checkpoint)\b"  # the model a figure came from
)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(first line, text with whitespace collapsed) of each block of consecutive comment lines and each docstring."""
    source = path.read_text()
    found: list[tuple[int, str]] = []
    block: list[str] = []
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if block and line != last + 1:
            found.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(token.string.lstrip("#").strip())
        last = line
    if block:
        found.append((start, " ".join(block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, " ".join(docstring.split())))
    return found


def measured_figures(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)!r} in {text[:100]!r}"
            for line, text in comments_and_docstrings(path) for match in MEASURED_FIGURE.finditer(text)]


def test_comments_carry_no_measured_figures():
    found = [figure for _, path in modules() for figure in measured_figures(path)]
    assert not found, ("comments and docstrings state the rule and point to docs/performance.md; these carry a "
                       "measured figure:\n" + "\n".join(found))


def test_pointers_to_the_docs_name_a_heading():
    def anchor(heading: str) -> str:  # as GitHub makes one
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    docs = Path(__file__).resolve().parents[1] / "docs"
    headings = {path.name: {anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
                for path in docs.glob("*.md")}
    broken = [f"{path.relative_to(PACKAGE.parent)}: {pointer.group(0)}" for _, path in modules()
              for pointer in re.finditer(r"docs/([\w-]+\.md)#([\w-]+)", path.read_text())
              if pointer.group(2) not in headings.get(pointer.group(1), set())]
    assert not broken, "pointers to no heading of the docs:\n" + "\n".join(broken)
