"""The import contract, read from the source (every import statement, also those inside functions):

- the torch-free side (trainer.core, trainer.errors, the family registry and specs, and everything they import;
  app/ and launch.py) never reaches torch or another heavy library, so the web UI's process stays light;
- trainer.core imports nothing of the engine; the families import nothing of the engine; app/ never imports
  the engine or gradio-free code pulls in gradio;
- trainer.core imports nothing of the families: it owns the FamilySpec contract and the registry
  (trainer.core.registry), which the families fill;
- no two modules import each other, directly or through others.

No list of torch-free modules is kept by hand: the closure is computed, so a new module is checked as soon as a
torch-free one imports it. The last test confirms at run time what the static reading says.
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torchvision", "diffusers", "transformers", "peft", "accelerate", "deepspeed", "torchao",
         "bitsandbytes", "xformers", "safetensors.torch", "faster_coco_eval", "torchmetrics")


def _modules() -> dict[str, Path]:
    found = {"launch": REPO / "launch.py"}
    for root in ("trainer", "app"):
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[str]:
    """Every module `name` imports (project modules resolved to the most specific one), in file order."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append(full if full in MODULES else base)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _heavy(target: str) -> bool:
    return any(target == h or target.startswith(h + ".") for h in HEAVY)


def _project(target: str) -> list[str]:
    """The project modules that importing `target` runs: the module and its packages' __init__ files."""
    parts = target.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in MODULES]


def _closure_problems(root: str, forbidden) -> list[str]:
    """Chains root -> ... -> X where X is forbidden (a heavy library, or a module a layer may not import)."""
    seen, stack, problems = {root}, [(root, [root])], []
    while stack:
        name, chain = stack.pop()
        for target in GRAPH[name]:
            if forbidden(target):
                problems.append(" -> ".join(chain + [target]))
                continue
            for module in _project(target):
                if module not in seen:
                    seen.add(module)
                    stack.append((module, chain + [module]))
    return problems


def _torch_free_roots() -> list[str]:
    roots = [m for m in MODULES if m.startswith(("trainer.core", "app")) or m in ("trainer.errors", "launch")]
    return roots + ["trainer.families"]  # the registry: every family's spec, read by the launcher and the UI


def test_the_torch_free_side_never_reaches_a_heavy_library():
    problems = [p for root in _torch_free_roots() for p in _closure_problems(root, _heavy)]
    assert not problems, "torch-free modules reach heavy libraries:\n" + "\n".join(sorted(set(problems)))


def test_the_family_specs_name_torch_free_checks_and_a_real_implementation():
    from trainer.families import SPECS

    for spec in SPECS.values():
        for ref in filter(None, (spec.checks, spec.data_check)):
            module = ref.partition(":")[0]
            assert module in MODULES, ref
            assert not _closure_problems(module, _heavy), f"{spec.name}: {ref} is run by the launcher: torch-free"
        module, _, attribute = spec.implementation.partition(":")
        assert f"class {attribute}" in MODULES[module].read_text(), spec.implementation


def test_layers():
    def engine(target: str) -> bool:
        return target.startswith("trainer.engine")

    def gradio(target: str) -> bool:
        return target == "gradio" or target.startswith("gradio.")

    problems = []
    for name in MODULES:
        if name.startswith(("trainer.core", "trainer.families", "app")) or name == "launch":
            problems += [f"{name} imports {t}" for t in GRAPH[name] if engine(t)]
        if name.startswith("trainer"):
            problems += [f"{name} imports {t}" for t in GRAPH[name] if gradio(t)]
    assert not problems, "\n".join(problems)


def test_core_never_imports_the_families():
    # Dependency inversion: the families depend on core, never the reverse (core looks a family up in
    # trainer.core.registry). GRAPH holds every import statement, those inside functions too.
    def family(target: str) -> bool:
        return target == "trainer.families" or target.startswith("trainer.families.")

    problems = [f"{name} imports {t}" for name in MODULES if name.startswith("trainer.core")
                for t in GRAPH[name] if family(t)]
    assert not problems, ("trainer.core must not import trainer.families: read the family through "
                          "trainer.core.registry, or move torch-free data into core:\n" + "\n".join(problems))


def test_no_import_cycles():
    edges = {name: {m for t in targets if t in MODULES for m in [t]} for name, targets in GRAPH.items()}
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in edges:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_ui_side_does_not_import_torch_at_run_time():
    roots = [m for m in _torch_free_roots() if not m.startswith("app")] + ["trainer.families.detection.data"]
    code = ("import sys, importlib\n"
            f"for name in {roots!r}: importlib.import_module(name)\n"
            "from trainer.families import SPECS\n"
            "print(','.join(m for m in ('torch', 'diffusers', 'transformers', 'gradio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
