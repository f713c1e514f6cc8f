"""Every code example we publish runs: docs pages, the README, and docstrings.

* Each ```` ```python ```` fenced block of ``README.md`` and of every ``docs/*.md`` page
  runs in order, all blocks of a page sharing one fresh module namespace, inside a
  temporary working directory: one test per page. Blocks in other languages
  (```` ```bash ````, ```` ```text ````) are not run. Tracebacks point at the line of
  the Markdown file. The page's module is not ``__main__``: code under
  ``if __name__ == "__main__":`` (a script meant for another process) does not run.
* The doctests (``>>>`` examples) in the docstrings of every ``scanax`` module run
  with ``doctest``: one test per module that has any.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import sys
import types
from pathlib import Path

import jax
import pytest

import scanax

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in docs must not open windows

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose examples assert what holds on this many devices (conftest.py forces
# 4 host devices on CPU; an accelerator machine has the devices it has). Every
# page was run with one device: only these failed.
DEVICES = {"multi_device.md": 4}

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$"
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each ```` ```python ```` block, in order.

    The info string must start with ``python`` or ``py`` (``python title="x.py"`` is
    fine); the block's indentation (e.g. inside a list item) is removed.
    """
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        lang = info.split()[0].lower() if info else ""
        body, start = [], i + 2  # 1-based number of the block's first line
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(
                fence[0]
            ):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        i += 1
        if lang in ("python", "py"):
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


def test_python_blocks_parser():
    text = (
        "intro\n```python\na = 1\n```\n```bash\nls\n```\n"
        '- item\n\n    ```python title="x.py"\n    b = a + 1\n    ```\n'
    )
    assert python_blocks(text) == [(3, "a = 1\n"), (11, "b = a + 1\n")]


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_docs_page(page, tmp_path, monkeypatch):
    need = DEVICES.get(page.name, 1)
    if jax.device_count() < need:
        pytest.skip(f"its examples need {need} devices (conftest.py forces 4 on CPU)")
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if not blocks:
        return  # a page without Python code has nothing to check
    monkeypatch.chdir(tmp_path)
    name = "scanax_docs_" + re.sub(r"\W", "_", page.stem)
    module = types.ModuleType(name)
    module.__file__ = str(page)
    # Registered so that dataclasses, pickling and typing can find the page's module.
    monkeypatch.setitem(sys.modules, name, module)
    for first_line, source in blocks:
        # Pad so that line numbers in tracebacks are the Markdown file's.
        code = compile("\n" * (first_line - 1) + source, str(page), "exec")
        exec(code, module.__dict__)


def _modules() -> list[types.ModuleType]:
    mods = [scanax]
    for info in pkgutil.walk_packages(scanax.__path__, "scanax."):
        if info.name != "scanax.__main__":
            mods.append(importlib.import_module(info.name))
    return mods


_FINDER = doctest.DocTestFinder()


def _doctests(module: types.ModuleType) -> list[doctest.DocTest]:
    return [t for t in _FINDER.find(module) if t.examples]


_DOCTEST_MODULES = [m for m in _modules() if _doctests(m)]


@pytest.mark.parametrize("module", _DOCTEST_MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    report: list[str] = []
    for test in _doctests(module):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, "".join(report)


def test_scan_docstring_has_an_example():
    """The core's docstring example is among those the suite runs."""
    names = {t.name for m in _DOCTEST_MODULES for t in _doctests(m)}
    assert "scan" in {n.rsplit(".", 1)[-1] for n in names}


def _count_eqns(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` in a jaxpr, nested ones included."""
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == name
        for sub in e.params.values():
            if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                n += _count_eqns(getattr(sub, "jaxpr", sub), name)
    return n


class _Cell:
    """A ``cell(h, x) -> h`` of state width ``dim``."""

    def __init__(self, d_in: int, dim: int):
        self.dim = dim
        self.w = jax.numpy.full((d_in, dim), 0.1)

    def __call__(self, h, x):
        return jax.numpy.tanh(x @ self.w + h)


@pytest.mark.parametrize(("order", "scans"), [("auto", 3), ("layer", 3), ("time", 1)])
def test_rnn_is_one_scan_per_layer_on_cpu(order, scans):
    """What docs/index.md and docs/migrating.md say: on CPU, ``order="auto"`` runs
    one scan over time per layer; ``order="time"`` runs one scan in all."""
    if jax.default_backend() != "cpu" and order == "auto":
        pytest.skip("order='auto' is one scan over time off CPU")
    cells = [_Cell(2, 4), _Cell(4, 3), _Cell(3, 5)]
    xs = jax.numpy.ones((7, 2))
    jaxpr = jax.make_jaxpr(lambda x: scanax.rnn(cells, x, order=order))(xs)
    assert _count_eqns(jaxpr.jaxpr, "scan") == scans


# ------------------------------------------------ issue 38: docs match the code


def public_names() -> list[str]:
    """What ``scanax/__init__.py`` re-exports (``from .x import a as a``, the
    form that makes a name public), in order."""
    import ast

    tree = ast.parse((ROOT / "scanax" / "__init__.py").read_text())
    return [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
        if alias.asname == alias.name
    ]


def documented_signature(text: str, call: str) -> inspect.Signature:
    """The signature of the first ``result = call(...)`` block of a page (the
    parameters as Python writes them, comments allowed), read with ``ast``."""
    import ast

    start = text.index(f"= {call}(")
    body, depth = [], 0
    for ch in text[start + len(f"= {call}(") - 1 :]:
        depth += ch == "("
        depth -= ch == ")"
        body.append(ch)
        if depth == 0:
            break
    params = re.sub(r"#[^\n]*", "", "".join(body))
    fn = ast.parse(f"def f{params}: pass").body[0]
    args = fn.args
    kinds = inspect.Parameter
    out = [kinds(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in args.args]
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        default = kinds.empty if d is None else ast.literal_eval(d)
        out.append(kinds(a.arg, kinds.KEYWORD_ONLY, default=default))
    if args.kwarg is not None:
        out.append(kinds(args.kwarg.arg, kinds.VAR_KEYWORD))
    return inspect.Signature(out)


def test_fits_documented_signature_is_its_real_one():
    """docs/fit.md's signature block, parsed, against ``scanax.fit``'s own:
    names, order, kinds and defaults (before: 13 of its keywords, and
    ``steps`` marked required)."""
    documented = documented_signature(
        (ROOT / "docs" / "fit.md").read_text(), "scanax.fit"
    )
    real = inspect.signature(scanax.fit).replace(
        return_annotation=inspect.Signature.empty
    )
    real = real.replace(
        parameters=[p.replace(annotation=p.empty) for p in real.parameters.values()]
    )
    assert list(documented.parameters) == list(real.parameters)
    for name, p in real.parameters.items():
        d = documented.parameters[name]
        assert (d.kind, d.default) == (p.kind, p.default), name


def test_every_public_name_is_on_the_index_and_the_api_page():
    names = public_names()
    assert {"fit", "evaluate", "linear_scan", "scan_until", "LRU"} <= set(names)
    index = (ROOT / "docs" / "index.md").read_text()
    api = (ROOT / "docs" / "api.md").read_text()
    for name in names:
        assert f"`scanax.{name}`" in index, name
        assert f"::: scanax.{name}\n" in api, name
    assert names == [n for n in names if hasattr(scanax, n)]


def test_the_readme_leads_with_the_commands_and_the_answers():
    """The two commands first, then the three answers; the long tables live on
    pages of their own (docs/features.md, docs/performance.md), linked."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert block.splitlines() == [
        'pip install -e ".[all]" && scanax demo',
        'pip install -e ".[test]" && python -m pytest -n 2 tests',
    ]
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "Three problems, three answers"
    first_table = text.index("\n|")
    assert text.index("### 3. Training inside one compiled loop") < first_table
    for page in ("features.md", "performance.md"):
        assert f"](docs/{page})" in text
        assert (ROOT / "docs" / page).exists()
    assert text.count("\n|") < 22  # (a few headline rows, not the tables)


def test_every_precision_fit_accepts_is_documented():
    """``precision=`` values ``fit`` accepts are each in its docstring (before:
    ``"float32"`` was accepted silently)."""
    from scanax._fit.callbacks import precision as _precision

    for value in _precision._KNOWN:
        assert f'"{value}"' in scanax.fit.__doc__, value
