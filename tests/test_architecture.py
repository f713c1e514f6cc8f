"""The floor plan of ``docs/architecture.md``: imports inside scanax only go down.

Every ``import`` of a scanax module by another, at module level or inside a function
(a lazy import is still a dependency), is read from the source with ``ast`` and
checked against ``LAYERS``: a module may import modules of its own layer or of a
lower one, never of a higher one, and the graph has no cycle. No module takes a
``_private`` name from another (``from ._loop import _x``): what a module offers
the rest of the package has a plain name. And a name is taken from the module that
defines it, not from one that imports it (``from ._axes import is_array`` hides
that ``is_array`` lives in ``_tree``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scanax"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "errors",
        {
            "_errors",
            "_errors.checkpoint",
            "_errors.fit",
            "_errors.models",
            "_errors.long",
            "_errors.rnn",
            "_errors.stack",
            "_errors.population",
            "_errors.log",
            "_errors.stop",
            "_errors.plot",
            "_errors.linear",
            "_errors.evaluate",
            "_errors.rollout",
            "_errors.execution",
            "_errors.plateau",
            "_errors.keys",
        },
    ),
    (
        "ground",
        {"_tree", "_fingerprint", "_nnx", "_axes", "_caller", "_backend", "_keys"},
    ),
    ("eager", {"_eager"}),
    ("layouts", {"_conv_layout"}),
    ("loop core", {"_loop"}),
    ("loop options", {"_remat", "_progress", "_thin"}),
    ("long scans", {"_long"}),
    ("scan", {"_scan", "_until", "_until_grad", "_linear_scan"}),
    ("stack and cells", {"_stack_plan", "_stack", "_cells", "_cells_linear"}),
    ("adapters and rnn", {"_stack_nnx", "_stack_eqx", "_stack_adapters", "_rnn"}),
    (
        "fit's parts",
        {
            "_feature",
            "_eval",
            "_shorthand",
            "_mesh",
            "_checkpoint",
            "_checkpointing",
            "_compile_cache",
            "_memory",
            "_model_step",
            "_models",
            "_models_nnx",
            "_models_optax",
            "_models_trainstate",
            "_data",
            "_targets",
            "_iterables",
            "_population",
            "_log",
            "_stop",
            "_plot",
            "_rollout",
            "_ema",
            "_precision",
            "_loss_scale",
            "_plateau",
        },
    ),
    ("fit's program", {"_fit_program", "_fit_chunks", "_fit_stepwise", "_metrics"}),
    (
        "fit's engine",
        {
            "_fit_checks",
            "_fit_history",
            "_fit_hooks",
            "_fit_loop",
            "_fit_logs",
            "_best",
            "_fit_result",
            "_fit_schedule",
        },
    ),
    ("fit's kinds", {"_fit_solo", "_fit_members"}),
    ("fit", {"_fit_population", "_fit", "_fit_config", "_evaluate"}),
    ("top", {"__init__", "__main__", "_demo"}),
]

# Imports that break the plan today, each as (importer, imported). Empty is the goal;
# an entry names whose file it is in.
KNOWN: set[tuple[str, str]] = set()
KNOWN_PRIVATE: set[tuple[str, str]] = set()
# Names taken from a module that only imports them, as (importer, name, module).
# Both are in files of fit's parts (``_data.py``, ``_models.py``): they should
# import ``is_array`` from ``_tree``; then delete these and ``_axes.py``'s
# re-export line.
KNOWN_REEXPORTED: set[tuple[str, str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [*PACKAGE.glob("*.py"), *PACKAGE.glob("_errors/*.py")]
    return {_module_name(p): p for p in sorted(files)}


MODULES = _modules()


def _package_of(name: str) -> list[str]:
    """The package a module's relative imports start from, as name parts."""
    if name == "__init__":
        return []
    path = MODULES[name]
    parts = name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def _resolve(base: list[str], names: list[str]) -> str:
    dotted = ".".join([*base, *names]) if [*base, *names] else "__init__"
    return dotted


def imports(name: str) -> list[tuple[str, int, list[str]]]:
    """``(module imported, line, names taken from it)`` for each scanax import."""
    tree = ast.parse(MODULES[name].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "scanax":
                    out.append((_resolve([], parts[1:]), node.lineno, []))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = _package_of(name)
            base = base[: len(base) - (node.level - 1)]
        elif node.module and node.module.split(".")[0] == "scanax":
            base = []
            node_module = node.module.split(".")[1:]
            target = _resolve(node_module, [])
            out += _from_names(target, node)
            continue
        else:
            continue
        target = _resolve(base, node.module.split(".") if node.module else [])
        out += _from_names(target, node)
    return out


def _from_names(target: str, node: ast.ImportFrom) -> list[tuple[str, int, list[str]]]:
    """``from target import a, b``: a submodule ``a`` counts as its own import."""
    out, names = [], []
    prefix = "" if target == "__init__" else target + "."
    for alias in node.names:
        sub = prefix + alias.name
        if sub in MODULES:
            out.append((sub, node.lineno, []))
        else:
            names.append(alias.name)
    if names:
        out.append((target, node.lineno, names))
    return out


def _layer_of() -> dict[str, int]:
    return {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def test_every_module_has_a_layer():
    layer = _layer_of()
    missing = sorted(set(MODULES) - set(layer))
    gone = sorted(set(layer) - set(MODULES))
    assert not missing, (
        f"add these modules to LAYERS (and docs/architecture.md): {missing}"
    )
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


def test_imports_only_go_down():
    layer = _layer_of()
    found = []
    for name in MODULES:
        for target, line, _ in imports(name):
            if target == name or (name, target) in KNOWN:
                continue
            if layer[target] > layer[name]:
                found.append(
                    f"scanax/{MODULES[name].relative_to(PACKAGE)}:{line}: {name} "
                    f"({LAYERS[layer[name]][0]}) imports {target} "
                    f"({LAYERS[layer[target]][0]})"
                )
    assert not found, "upward imports:\n" + "\n".join(found)


def test_no_import_cycle():
    graph = {
        name: {t for t, _, _ in imports(name) if t != name and (name, t) not in KNOWN}
        for name in MODULES
    }
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> list[str] | None:
        if node in stack:
            return [*stack[stack.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            cycle = visit(nxt, [*stack, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_names_taken_from_another_module():
    found = [
        f"{name} takes {', '.join(n for n in names if n.startswith('_'))} from {target}"
        for name in MODULES
        for target, _, names in imports(name)
        if any(n.startswith("_") and (name, n) not in KNOWN_PRIVATE for n in names)
    ]
    assert not found, "\n".join(found)


def defines(name: str) -> set[str]:
    """The names module ``name`` binds itself at its top level (functions,
    classes, assignments, also under ``if``/``try``), not by importing them."""

    def bound(body: list[ast.stmt]) -> set[str]:
        own = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                own |= {
                    n.id
                    for t in targets
                    for n in ast.walk(t)
                    if isinstance(n, ast.Name)
                }
            elif isinstance(node, (ast.If, ast.Try)):
                handlers = getattr(node, "handlers", [])
                for part in (node.body, node.orelse, getattr(node, "finalbody", [])):
                    own |= bound(part)
                for handler in handlers:
                    own |= bound(handler.body)
        return own

    return bound(ast.parse(MODULES[name].read_text()).body)


def _reexported() -> set[tuple[str, str, str]]:
    return {
        (name, n, target)
        for name in MODULES
        for target, _, names in imports(name)
        if target != "__init__"  # the package's re-exports are its purpose
        for n in names
        if n not in defines(target)
    }


def test_names_are_taken_from_where_they_live():
    found = sorted(_reexported() - KNOWN_REEXPORTED)
    assert not found, "\n".join(
        f"{name} takes {n} from {target}, which does not define it"
        for name, n, target in found
    )


def test_known_violations_are_still_violations():
    """An allowance in ``KNOWN`` or ``KNOWN_REEXPORTED`` that is no longer needed
    is removed."""
    layer = _layer_of()
    for name, target in KNOWN:
        assert target in {t for t, _, _ in imports(name)}, (name, target)
        assert layer[target] >= layer[name], (name, target)
    stale = KNOWN_REEXPORTED - _reexported()
    assert not stale, stale


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_errors.rnn", {"_errors"}),
        ("__main__", {"_demo"}),
    ],
)
def test_imports_are_read(name, expected):
    """The parser sees relative, package-level and function-level imports."""
    assert expected <= {t for t, _, _ in imports(name)}


def test_only_the_adapters_touch_flax_nnx():
    """``_nnx.py`` is the core's one door to ``flax.nnx`` (the Stack adapter
    ``_stack_nnx.py`` and fit's NNX adapter in ``_models_nnx.py`` import it too, and
    so does ``_demo.py``, a user's program)."""
    allowed = {"_nnx", "_stack_nnx", "_models_nnx", "_demo", "_cells_linear"}
    found = []
    for name, path in MODULES.items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = ast.unparse(node) if isinstance(node, ast.stmt) else ""
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "flax" in text:
                found.append(f"{name}:{node.lineno}: {text}")
            elif isinstance(node, ast.Constant) and node.value == "flax.nnx":
                found.append(f"{name}:{node.lineno}: 'flax.nnx'")
    assert not found, "\n".join(found)


FIT_WING = [
    "_data",
    "_iterables",
    "_model_step",
    "_models",
    "_models_nnx",
    "_models_optax",
    "_models_trainstate",
    "_mesh",
    "_checkpoint",
    "_checkpointing",
    "_compile_cache",
    "_memory",
    "_population",
    "_log",
    "_stop",
    "_plot",
    "_fit_program",
    "_fit_chunks",
    "_fit_checks",
    "_fit_history",
    "_fit_hooks",
    "_fit_loop",
    "_fit_schedule",
    "_fit_result",
    "_fit_solo",
    "_fit_members",
    "_fit_population",
    "_fit_config",
    "_fit",
    "_feature",
    "_eval",
    "_shorthand",
    "_ema",
    "_plateau",
    "_precision",
    "_loss_scale",
    "_rollout",
]


def test_the_fit_wing_has_one_training_loop():
    """One loop program for a single model and a population: the fit wing calls
    ``lax.while_loop`` in one place (``_fit_chunks.build_chunk``); what differs
    between them is a ``Lanes`` strategy."""
    sites = []
    for name in FIT_WING:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "while_loop"
            ):
                sites.append(f"{name}:{node.lineno}")
    assert len(sites) == 1 and sites[0].startswith("_fit_chunks:"), sites


def test_one_placement_object_decides_mesh_or_not():
    """Whether on a mesh or not is decided by ``_mesh.Placement`` (put, replicate,
    constrain, state shardings, host values, members): no module of the fit
    wing, nor the data sources or ``evaluate``, compares a mesh with None."""
    sites = []
    names = {*FIT_WING, "_data", "_rollout", "_evaluate"} - {"_mesh"}
    for name in sorted(names):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or len(node.comparators) != 1:
                continue
            left, right = node.left, node.comparators[0]
            is_none = isinstance(right, ast.Constant) and right.value is None
            names_mesh = (isinstance(left, ast.Name) and left.id == "mesh") or (
                isinstance(left, ast.Attribute) and left.attr == "mesh"
            )
            if is_none and names_mesh and isinstance(node.ops[0], (ast.Is, ast.IsNot)):
                sites.append(f"{name}:{node.lineno}")
    # evaluate's own argument check (a mesh given or not, before it is placed)
    assert [s for s in sites if not s.startswith("_evaluate:")] == [], sites
    assert len(sites) <= 1, sites
