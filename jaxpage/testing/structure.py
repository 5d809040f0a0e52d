"""The code's structure, as evidence a reader can re-run: the import graph of jaxpage and serving (every import
counted: top level, inside functions, under TYPE_CHECKING), its layers and any import that points up a layer, the
longest functions, and module sizes.

    python jaxpage/testing/structure.py                  # this checkout
    python jaxpage/testing/structure.py --root OTHER     # another checkout (e.g. a git worktree of an older commit)

tests/test_import_graph.py enforces the graph with these functions."""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("pallas_kernels", "jaxpage", "serving")
PACKAGES = (*PRODUCT_PACKAGES, "benchmarks")
# Bottom to top. A module's layer is the first prefix it starts with; a layer may import its own and lower ones.
# serving -> jaxpage -> kernels: the Pallas kernels import nothing of jaxpage, the CPU kernels sit under the model.
LAYERS = (
    ("kernels", ("pallas_kernels",)),
    ("base", ("jaxpage.config", "jaxpage.utils", "jaxpage.sampling_params", "jaxpage.pooling_params",
              "jaxpage.structured_outputs", "jaxpage.outputs", "jaxpage.sequence")),
    ("cpu_kernels", ("jaxpage.cpu_kernels",)),
    ("distributed", ("jaxpage.distributed",)),
    ("attention", ("jaxpage.attention",)),
    ("models", ("jaxpage.models",)),
    ("structured", ("jaxpage.structured",)),
    ("lora", ("jaxpage.lora",)),
    ("spec_decode", ("jaxpage.spec_decode",)),
    ("core", ("jaxpage.core",)),
    ("worker", ("jaxpage.worker",)),
    ("engine", ("jaxpage.engine",)),
    ("entrypoints", ("jaxpage.entrypoints",)),
    ("serving", ("serving",)),
    ("testing", ("jaxpage.testing",)),
    ("benchmarks", ("benchmarks",)),
)


def module_names(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module, subpackages' too (a subpackage's __init__ is the subpackage; the top packages' own
    __init__ files, which only re-export, are left out)."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if len(parts) > 1 and not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                names[".".join(parts)] = path
    return names


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file imports anywhere (top level or in a function)."""
    found, stack = set(), [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
        stack.extend(ast.iter_child_nodes(node))
    return found & modules


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module's imports of the other modules."""
    names = module_names(root)
    return {name: imports_of(path, set(names)) - {name} for name, path in names.items()}


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer, as a sentence."""
    return sorted(f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
                  for name, deps in graph.items() for dep in deps if layer_of(dep) > layer_of(name))


def longest_functions(root: Path = ROOT, most: int = 15) -> list[tuple[int, str]]:
    """(lines, "path:line name") of the longest functions and methods of the product packages, longest first."""
    found = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                    found.append((node.end_lineno - node.lineno + 1, where))
    return sorted(found, reverse=True)[:most]


def report(root: Path) -> dict:
    graph = import_graph(root)
    try:
        upward = upward_imports(graph)
    except AssertionError as unlayered:  # a checkout from before the layer folders
        upward = [str(unlayered)]
    return {"modules": len(graph), "import_edges": sum(map(len, graph.values())), "cycle": find_cycle(graph),
            "upward_imports": upward, "longest_functions": longest_functions(root)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    found = report(args.root.resolve())
    print(f"{found['modules']} modules, {found['import_edges']} import edges")
    print("import cycle:", " -> ".join(found["cycle"]) if found["cycle"] else "none")
    print("imports up a layer:", "none" if not found["upward_imports"] else "")
    for line in found["upward_imports"]:
        print("  " + line)
    print("longest functions (lines):")
    for lines, where in found["longest_functions"]:
        print(f"  {lines:4d}  {where}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
