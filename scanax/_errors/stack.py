"""Messages of ``scanax.Stack``'s errors."""

from __future__ import annotations

import difflib
from typing import Any

import jax.tree_util as jtu

from . import added_removed, short_type

CALL = "scanax.Stack"


def not_sequence(layers: Any) -> TypeError:
    if hasattr(layers, "layers") and callable(layers):  # (an nnx.Sequential)
        fix = f"pass its layers: Stack(list({type(layers).__name__.lower()}.layers))"
    else:
        fix = (
            "pass Stack([layer_0, layer_1, ...]). Layers already stacked into one "
            "(nnx.vmap, eqx.filter_vmap: each parameter with a leading layer axis) "
            "are unstacked with `[jax.tree.map(lambda a: a[i], stacked) for i in "
            "range(n)]`"
        )
    return TypeError(
        f"{CALL}: `layers` must be a sequence of layers (a list, a tuple, an "
        f"nnx.List), got {short_type(layers)}.\nFix: {fix}."
    )


def layers_as_arguments(n: int) -> TypeError:
    return TypeError(
        f"{CALL}: got {n} layers as separate arguments; Stack takes one sequence "
        "of them (unlike nnx.Sequential).\n"
        "Fix: pass them in a list: Stack([layer_0, layer_1, ...])."
    )


def empty() -> ValueError:
    return ValueError(f"{CALL}: `layers` is empty.\nFix: pass at least one layer.")


def not_callable(i: int, layer: Any) -> TypeError:
    return TypeError(
        f"{CALL}: layers[{i}] is not callable: got {short_type(layer)}.\n"
        "Fix: every layer must be callable as layer(x, **kwargs) -> x."
    )


def layer_failed(i: int, layer: Any, x: Any, kwargs: list[str], err: Exception):
    """A ``TypeError`` (a ``ValueError`` for one): layer ``i`` failed on ``x``."""
    leaves = jtu.tree_flatten_with_path(x)[0]
    x = ", ".join(f"{jtu.keystr(p) or 'x'} {short_type(v)}" for p, v in leaves)
    before = f"the output of layers[{i - 1}]" if i else "the Stack's input"
    given = (
        f" and the keyword arguments {kwargs} (a keyword for some layers only: "
        "per_layer=)"
        if kwargs
        else ""
    )
    message = (
        f"{CALL}: layers[{i}] ({short_type(layer)}) raised {type(err).__name__} "
        f"on its input {x}:\n  {err}\nThe layers run in order, each on the output "
        f"of the one before.\nFix: layers[{i}] must take {before}{given}; else "
        "the error is in the layer itself (see the traceback above)."
    )
    return ValueError(message) if isinstance(err, ValueError) else TypeError(message)


def bad_index(i: int, n: int) -> IndexError:
    return IndexError(
        f"{CALL}: index {i} is out of range for a Stack of {n} layers (valid: "
        f"{-n}..{n - 1})."
    )


def bad_index_type(i: Any) -> TypeError:
    return TypeError(
        f"{CALL}: a Stack is indexed by one integer, got {short_type(i)}"
        f"{f' {i!r}' if isinstance(i, (bool, slice)) else ''}.\nFix: use stack[i] "
        "with an int (a traced index cannot pick a layer: layers differ in type), "
        "or list(stack)[a:b] for several layers."
    )


def shared(i: int, j: int, path: str, rng: bool = False) -> ValueError:
    fix = (
        "give each layer its own random stream: build it with `rngs.fork()` (e.g. "
        "`[Block(rngs.fork()) for _ in range(n)]`), or pass keys per layer with "
        "per_layer="
        if rng
        else "build each layer with its own Variables (share weights explicitly, "
        "outside the Stack)"
    )
    return ValueError(
        f"{CALL}: layers[{i}] and layers[{j}] share the Variable at {path}; stacked "
        f"layers must own their Variables.\nFix: {fix}."
    )


def variable_not_an_array(i: int, path: str, var: Any, leaf: Any) -> TypeError:
    return TypeError(
        f"{CALL}: layers[{i}]{path} ({type(var).__name__}) holds "
        f"{short_type(leaf)}; a Stack stacks the values of Variables as arrays, so "
        "they must be arrays or numbers.\nFix: keep a value that is not an array "
        "as a plain attribute (static, not a Variable), or store it as an array."
    )


def mixed(i: int, layer: Any, j: int, other: Any) -> TypeError:
    return TypeError(
        f"{CALL}: layers[{i}] is a {type(layer).__name__} (Flax NNX) but layers[{j}] "
        f"is a {type(other).__name__} holding arrays outside NNX Variables.\nFix: "
        "build all layers with one framework (NNX modules, or Equinox modules and "
        "plain functions)."
    )


def bad_remat(remat: Any) -> TypeError:
    return TypeError(
        f'{CALL}: `remat` must be None, False, True, "sqrt" or a '
        f"jax.checkpoint_policies policy, got {short_type(remat)} {remat!r}.\nFix: "
        "leave it out (stacked runs then keep only matmul results for the backward "
        'pass), or pass remat=True to recompute every layer, remat="sqrt" for a '
        "long stack, or e.g. remat=jax.checkpoint_policies.dots_saveable."
    )


def unexpected_keyword(name: str, known: list[str]) -> TypeError:
    close = difflib.get_close_matches(name, ["layers", *known], n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return TypeError(
        f"{CALL}() got an unexpected keyword argument {name!r}.{hint}\nFix: "
        f"Stack takes `layers` and the keywords {', '.join(known)}; a layer's "
        "own arguments go to its constructor, and keyword arguments for every "
        "call go to stack(x, **kwargs)."
    )


def per_layer_type(per_layer: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `per_layer` must be a dict of keyword arguments, got "
        f"{short_type(per_layer)}.\nFix: pass per_layer={{'key': keys}}, each leaf an "
        "array with one entry per layer along axis 0."
    )


def per_layer_leaf(path: str, leaf: Any, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: per_layer{path} is {short_type(leaf)}, but it needs a leading axis "
        f"of length {n}, one entry per layer.\nFix: stack one value per layer, e.g. "
        f"jax.random.split(key, {n})."
    )


def run_leaf_unstacked(layers: str, name: str, leaf: Any, repeats: int) -> ValueError:
    return ValueError(
        f"{CALL}: the stacked run of {layers} holds {name} = {short_type(leaf)}, "
        f"without the leading axis of its {repeats} blocks: a value added to the "
        "layers after the Stack was built (a decoding cache made by "
        "`init_cache` through `nnx.iter_modules`, a Variable assigned) is not "
        "stacked.\nFix: add it to the layers before building the Stack "
        "(e.g. call each attention layer's `init_cache` first), or stack it "
        f"yourself with a leading axis of {repeats}."
    )


def graph_changed(added: list[str], removed: list[str]) -> TypeError:
    what = added_removed(
        added, removed, "the same values, with a Variable's type changed"
    )
    return TypeError(
        f"{CALL}: a layer of a stacked run stored new values or deleted some while "
        f"running ({what}). A stacked run carries its layers' fixed set of "
        "Variables through one loop, so it cannot keep new ones.\nFix: return the "
        "value from the layer instead of storing it: `Module.sow` (with or without "
        "`nnx.capture`) stores by adding to the layer's Variables. A layer that is "
        "not stacked (called directly) may sow."
    )


def kwarg_mutated(names: list[str], n: int) -> ValueError:
    return ValueError(
        f"{CALL}: the layers change the NNX object passed as keyword argument "
        f"{', '.join(names)}. A Stack passes keyword arguments unchanged to every "
        "layer of its loops, so changes to them cannot persist (a Python loop "
        "would advance a shared `nnx.Rngs` from layer to layer).\nFix: pass "
        "one random key per layer instead, e.g. "
        f"`stack(x, per_layer={{'rngs': jax.random.split(key, {n})}})`, or "
        "give each layer its own `nnx.Rngs` when you build it."
    )


def unstacked_by_numbers(
    found: list[tuple[int, int, list[tuple[str, Any, Any]]]],
    layers: Any,
    described: str,
) -> str:
    """The warning for layers of one class left unstacked by a differing number."""
    i, j, diffs = found[0]
    path, a, b = diffs[0]
    fields = list(dict.fromkeys(p.lstrip(".") for _, _, d in found for p, _, _ in d))
    name = path.rsplit(".", 1)[-1].strip("[]'\"") or "idx"
    pairs = f"; {len(found)} such pairs" if len(found) > 1 else ""
    return (
        f"{CALL}: layers[{i}] and layers[{j}] ({type(layers[i]).__name__}) differ "
        f"only in a number, `{path.lstrip('.')}` ({a!r} against {b!r}{pairs}, in "
        f"{', '.join(f'`{f}`' for f in fields)}), so they cannot share one scan: a "
        "Python number is part of a layer's structure, not stacked like an array. "
        f"Each such layer is traced on its own: Stack({described}).\nFix: hold the "
        "number as an array, stacked with the weights (Equinox: a field that is not "
        f"`eqx.field(static=True)`, set to `jnp.asarray({name})`; NNX: "
        f"`self.{name} = nnx.Variable(jnp.asarray({name}))`), or make it a call "
        "argument of the layer and pass one per layer, e.g. "
        f"`stack(x, per_layer={{{name!r}: jnp.arange({len(layers)})}})`. If the "
        "layer needs a Python number (a shape, a dilation), keep it and silence this "
        "with `warnings.simplefilter('ignore', scanax.StackWarning)`."
    )
