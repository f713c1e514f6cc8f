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
        {"_tree", "_fingerprint", "_nnx", "_axes", "_caller", "_backend", "_once"},
    ),
    ("eager", {"_eager"}),
    ("layouts", {"_conv_layout"}),
    ("loop core", {"_loop"}),
    ("loop options", {"_remat", "_progress", "_thin"}),
    ("long scans", {"_long"}),
    ("scan", {"_scan", "_until", "_until_grad", "_linear_scan"}),
    ("stack and cells", {"_stack_plan", "_stack", "_cells", "_cells_linear"}),
    ("adapters and rnn", {"_stack_nnx", "_stack_eqx", "_stack_adapters", "_rnn"}),
    # The fit wing, scanax/_fit/ (docs/architecture.md draws it).
    (
        "fit's floor",
        {
            "_fit",
            "_fit.keys",
            "_fit.feature",
            "_fit.mesh",
            "_fit.processes",
            "_fit.checkpoint",
            "_fit.compile_cache",
            "_fit.scalars",
            "_fit.memory",
            "_fit.plot",
        },
    ),
    (
        "fit's models",
        {
            "_fit.models",
            "_fit.models.step",
            "_fit.models.adapt",
            "_fit.models.nnx",
            "_fit.models.optax",
            "_fit.models.optax_init",
            "_fit.models.eqx_state",
            "_fit.models.trainstate",
            "_fit.models.population",
        },
    ),
    (
        "fit's data",
        {
            "_fit.data",
            "_fit.data.arrays",
            "_fit.data.iterables",
            "_fit.data.rollout",
            "_fit.targets",
        },
    ),
    (
        "fit's features",
        {
            "_fit.callbacks",
            "_fit.callbacks.checkpoint",
            "_fit.callbacks.evaluation",
            "_fit.callbacks.early_stop",
            "_fit.callbacks.ema",
            "_fit.callbacks.plateau",
            "_fit.callbacks.precision",
            "_fit.callbacks.loss_scale",
            "_fit.callbacks.sinks",
        },
    ),
    (
        "fit's program",
        {"_fit.program", "_fit.plan", "_fit.chunks", "_fit.stepwise", "_fit.metrics"},
    ),
    (
        "fit's engine",
        {
            "_fit.checks",
            "_fit.history",
            "_fit.hooks",
            "_fit.engine",
            "_fit.logs",
            "_fit.callbacks.best",
            "_fit.result",
            "_fit.schedule",
        },
    ),
    ("fit's kinds", {"_fit.solo", "_fit.members"}),
    (
        "fit",
        {
            "_fit.population",
            "_fit.api",
            "_fit.config",
            "_fit.shorthand",
            "_fit.evaluate",
        },
    ),
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
    files = PACKAGE.rglob("*.py")
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
    ``_stack_nnx.py`` and fit's NNX adapter in ``_fit/models/nnx.py`` import it too, and
    so does ``_demo.py``, a user's program)."""
    allowed = {"_nnx", "_stack_nnx", "_fit.models.nnx", "_demo", "_cells_linear"}
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


FIT_WING = sorted(name for name in MODULES if name.split(".")[0] == "_fit")


def test_the_fit_wing_has_one_training_loop():
    """One loop program for a single model and a population: the fit wing calls
    ``lax.while_loop`` in one place (``_fit/chunks.py``); what differs
    between them is a ``Lanes`` strategy."""
    sites = []
    for name in FIT_WING:
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "while_loop"
            ):
                sites.append(f"{name}:{node.lineno}")
    assert len(sites) == 1 and sites[0].startswith("_fit.chunks:"), sites


def test_one_placement_object_decides_mesh_or_not():
    """Whether on a mesh or not is decided by ``_fit/mesh.py``'s ``Placement`` (put, replicate,
    constrain, state shardings, host values, members): no module of the fit
    wing, nor the data sources or ``evaluate``, compares a mesh with None."""
    sites = []
    names = set(FIT_WING) - {"_fit.mesh"}
    for name in sorted(names):
        tree = ast.parse(MODULES[name].read_text())
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
    assert [s for s in sites if not s.startswith("_fit.evaluate:")] == [], sites
    assert len(sites) <= 1, sites


# ------------------------------------------------------------------ issue 35's shape


def _tree_of(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text())


def test_fit_wing_modules_stay_small():
    """A module of the fit wing reads in one sitting: under 550 lines (the
    three flat files this package replaced had 745, 696 and 654)."""
    long = {
        name: n
        for name in FIT_WING
        if (n := len(MODULES[name].read_text().splitlines())) > 550
    }
    assert not long, long


def test_fit_reads_as_its_steps():
    """``fit``'s body (docstring aside) is a few lines per step: the keywords
    mapped to feature objects, the arguments checked into one ``Config``, one
    kind run (a model or a population); it had 135 body lines."""
    fn = next(
        n
        for n in _tree_of("_fit.api").body
        if isinstance(n, ast.FunctionDef) and n.name == "fit"
    )
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body
    lines = body[-1].end_lineno - body[0].lineno + 1
    assert lines < 60, lines


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                ):
                    out.add(n.attr)
    return out


def test_the_driver_keeps_few_attributes_and_the_kinds_return_values():
    """``engine.Run`` holds at most 14 attributes (it had 30), and the kinds
    (one model, a population's lanes) change it only through what their
    methods return: no ``run.<attribute> = ...`` outside ``engine``."""
    run = next(
        n
        for n in _tree_of("_fit.engine").body
        if isinstance(n, ast.ClassDef) and n.name == "Run"
    )
    attrs = _self_assigned(run)
    assert len(attrs) <= 14, sorted(attrs)
    found = []
    for name in ("_fit.solo", "_fit.members", "_fit.population"):
        for node in ast.walk(_tree_of(name)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "run"
                ):
                    found.append(f"{name}:{t.lineno} run.{t.attr}")
    assert not found, found


def _classes(name: str) -> list[ast.ClassDef]:
    return [n for n in ast.walk(_tree_of(name)) if isinstance(n, ast.ClassDef)]


def test_one_class_per_feature_for_a_model_and_a_population():
    """A feature is one class whatever trains it: no module of the fit wing
    defines a wrapper or a population twin of a feature (the single-model and
    population wrappers of ``ema``, ``plateau``, float16 loss scaling and the
    rollout feed are gone), and each feature module of ``_fit/callbacks/``
    defines its feature classes and no other ``Feature``. (The model kinds'
    adapters in ``_fit/models/`` are what a model is, not a feature.)"""
    twins = [
        f"{name}.{cls.name}"
        for name in FIT_WING
        for cls in _classes(name)
        if cls.name.endswith(("Wrapper", "Wrapped"))
        or (cls.name.endswith("Adapter") and not name.startswith("_fit.models"))
        or (cls.name.startswith("Population") and name != "_fit.models.population")
        or (cls.name.startswith(("Pop", "Member")) and "Feature" in ast.unparse(cls))
    ]
    assert not twins, twins

    def features(name: str) -> list[str]:
        return [
            c.name
            for c in _classes(name)
            if any(ast.unparse(b).endswith("Feature") for b in c.bases)
        ]

    outside = {
        name: found
        for name in FIT_WING
        if not name.startswith("_fit.callbacks")
        and name not in ("_fit.feature", "_fit.data.rollout")
        and (found := features(name))
    }
    assert not outside, outside
    # one module per feature: every public feature class in callbacks/ or the
    # rollout feed, and each such module names its features in one place
    import scanax

    for cls_name in ("Eval", "EarlyStop", "Ema", "Plateau", "Precision", "Checkpoint"):
        module = getattr(scanax, cls_name).__module__
        assert module.startswith("scanax._fit.callbacks."), (cls_name, module)
