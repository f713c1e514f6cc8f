"""Message builders for scanax's errors.

Every message starts with the public call (``scanax.scan: ...``), names each offending
leaf by pytree path with a short type (``float32[5, 4]``), says what was expected and
ends with the fix. This module holds the shared helpers and the messages of
``scanax.scan``; the other calls have one module each: ``stack`` (``scanax.Stack``),
``rnn`` (``scanax.rnn``/``birnn``), ``long`` (``keep_every``/``keep``, ``remat``,
``progress``, ``scanax.scan_until``), ``linear`` (``scanax.linear_scan``), ``fit``
(``scanax.fit``: arguments, models and optimizers, data, checkpoints, meshes),
``rollout`` (``scanax.Rollout``), ``evaluate`` (``scanax.evaluate``/``predict``)
and the fit wing's others (``population``, ``log``, ``stop``, ``checkpoint``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def added_removed(added: list[str], removed: list[str], otherwise: str) -> str:
    """``added a, b; removed c`` for a change of names, or ``otherwise``."""
    changes = [f"added {', '.join(added)}"] if added else []
    changes += [f"removed {', '.join(removed)}"] if removed else []
    return "; ".join(changes) or otherwise


class NNXMutation(ValueError):
    """``f`` changed an NNX object it does not carry: callers that passed the object
    on the user's behalf (``scanax.Stack``'s keyword arguments) say so instead."""


class RefNotWritable(TypeError):
    """A batched or differentiated value for an array ref outside the
    transformation (``paths``: the Variables' graph paths)."""

    def __init__(self, message: str, paths: list[tuple], kind: str):
        super().__init__(message)
        self.paths, self.kind = paths, kind


def short_type(x: Any) -> str:
    """``float32[5, 4]`` for arrays and shape/dtype structs, else the type name."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            name = str(dtype)
        else:
            name = np.dtype(dtype).name
        weak = "~" if getattr(x, "weak_type", False) else ""
        return f"{weak}{name}[{', '.join(map(str, shape))}]"
    if isinstance(x, (bool, int, float, complex)):
        return f"{type(x).__name__} {x!r}"
    return type(x).__name__


def listing(rows: list[tuple[str, str]]) -> str:
    width = max((len(a) for a, _ in rows), default=0)
    return "\n".join(f"  {a.ljust(width)}  {b}" for a, b in rows)


def conv_layout_unavailable(version: str) -> str:
    """The warning of a JAX without ``jax.extend.core``: convolutions in loop
    bodies left as traced on CPU."""
    return (
        f"scanax.scan: this JAX ({version}) has no `jax.extend.core`, which scanax "
        "reads to rewrite the convolutions of a loop body (`scanax.scan`, "
        "`scanax.fit`'s step) into the layout XLA:CPU runs fast there; they run as "
        "traced, with the same values, possibly many times slower on CPU.\nFix: "
        "use a JAX release scanax supports (see its `jax` requirement), or silence "
        "this with `warnings.simplefilter('ignore', RuntimeWarning)`."
    )


def not_callable(call: str, f: Any) -> TypeError:
    return TypeError(
        f"{call}: `f` must be callable as f(carry, x) -> (carry, y), "
        f"got {short_type(f)}.\nFix: pass the loop body function first."
    )


def bad_length(call: str, length: Any) -> Exception:
    if isinstance(length, jax.core.Tracer):
        return TypeError(
            f"{call}: `length` must be a concrete Python int, but it is a traced "
            f"value ({short_type(length)}), e.g. an argument of a jitted function.\n"
            "Fix: make it static (`jax.jit(..., static_argnums=...)`) or pass a "
            "Python int; the number of iterations must be known at compile time."
        )
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        return TypeError(
            f"{call}: `length` must be a non-negative Python int or None, got "
            f"{short_type(length)}.\nFix: pass the number of iterations as an int, "
            "e.g. length=100."
        )
    return ValueError(
        f"{call}: `length` must be non-negative, got {length}.\n"
        "Fix: pass the number of iterations (0 or more)."
    )


def bad_unroll(call: str, unroll: Any) -> Exception:
    message = (
        f"{call}: `unroll` must be a bool or a non-negative int (as in "
        f"jax.lax.scan), got {type(unroll).__name__} {unroll!r}.\nFix: pass e.g. "
        "unroll=2 (two steps per loop iteration), or unroll=True (the whole loop)."
    )
    return ValueError(message) if isinstance(unroll, int) else TypeError(message)


def no_length(call: str) -> ValueError:
    return ValueError(
        f"{call}: cannot tell how many iterations to run: `xs` is None and `length` "
        "is None.\nFix: pass `length=n`, or pass `xs` with a leading axis to scan "
        "over."
    )


def all_broadcast(call: str) -> ValueError:
    return ValueError(
        f"{call}: every leaf of `xs` is broadcast (in_axes None), so there is no "
        "axis to take the number of iterations from, and `length` is None.\n"
        "Fix: pass `length=n`, or scan some leaf with an integer in_axes."
    )


def lengths_differ(call: str, rows: list[tuple[str, int, str]]) -> ValueError:
    body = listing([(p, f"{t}: length {n}") for p, n, t in rows])
    return ValueError(
        f"{call}: the scanned leaves of `xs` have different lengths along their "
        f"scanned axes:\n{body}\nFix: give every scanned leaf the same length, or "
        "broadcast the ones that are the same at every step with in_axes=None."
    )


def length_mismatch(
    call: str, length: int, rows: list[tuple[str, int, str]]
) -> ValueError:
    body = listing([(p, f"{t}: length {n}") for p, n, t in rows])
    return ValueError(
        f"{call}: `length={length}` disagrees with the scanned leaves of `xs`:\n"
        f"{body}\nFix: drop `length` (it is inferred from `xs`), or slice `xs` to "
        f"{length} steps."
    )


def not_scannable(call: str, path: str, leaf: Any, axis: int) -> TypeError:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return TypeError(
            f"{call}: {path} is {short_type(leaf)}, a 0-d array, which has no axis "
            f"{axis} to scan over.\nFix: give it a leading time axis, or broadcast "
            "it with in_axes=None if it is the same at every step."
        )
    return TypeError(
        f"{call}: {path} is a {short_type(leaf)}, not an array, so it cannot be "
        f"scanned over (in_axes {axis}).\nFix: broadcast it with in_axes=None (it "
        "then reaches `f` unchanged at every step), or make it an array. A leaf "
        "inside a module (an Equinox layer stacked by filter_vmap) takes an "
        "in_axes tree of the module's shape: `jax.tree.map(lambda x: 0 if "
        "eqx.is_array(x) else None, xs)`."
    )


def axis_out_of_range(
    call: str, path: str, leaf: Any, axis: int, what: str
) -> ValueError:
    ndim = len(leaf.shape)
    return ValueError(
        f"{call}: {what} {axis} is out of range for {path}, which is "
        f"{short_type(leaf)} ({ndim} axes, so valid axes are {-ndim}..{ndim - 1}).\n"
        f"Fix: use an axis in that range."
    )


def bad_axis_value(call: str, what: str, path: str, value: Any) -> TypeError:
    if what == "out_axes":
        return TypeError(
            f"{call}: out_axes may hold only ints, but out_axes{path} is "
            f"{short_type(value)}.\nFix: use an int (where the step axis goes in "
            "that output; 0, the default, keeps it first)."
        )
    return TypeError(
        f"{call}: {what} may hold only ints and None, but {what}{path} is "
        f"{short_type(value)}.\nFix: use an int (the axis to scan over) or None "
        "(broadcast: the same value at every step)."
    )


def out_axis_none(call: str, path: str) -> TypeError:
    return TypeError(
        f"{call}: out_axes gives ys{path} None, but every output of a scan has a "
        "step axis, and out_axes says where it goes.\nFix: use an int there (0, "
        "the default, keeps it first); a value that does not change over the "
        "steps belongs in the carry."
    )


def prefix_mismatch(call: str, what: str, tree_name: str, detail: str) -> ValueError:
    example = (
        "in_axes=(0, None) for xs=(inputs, state)"
        if what == "in_axes"
        else f"{what}=(0, 1) for {tree_name}=(a, b)"
    )
    kinds = "an int, None," if what == "in_axes" else "an int"
    return ValueError(
        f"{call}: {what} must be {kinds} or a pytree prefix of `{tree_name}`, "
        f"but {detail}.\nFix: give {what} the same container structure as "
        f"`{tree_name}` (or a prefix of it), e.g. {example}."
    )


def not_a_pair(call: str, out: Any) -> TypeError:
    if isinstance(out, (tuple, list)):
        got = f"a {type(out).__name__} of length {len(out)}"
    else:
        got = short_type(out)
    return TypeError(
        f"{call}: `f` must return a pair (new_carry, y), but it returned {got}.\n"
        "Fix: end the body with `return carry, y` "
        "(use `return carry, None` when there is no per-step output)."
    )


def carry_mismatch(call: str, rows: list[tuple[str, Any, Any]]) -> TypeError:
    """``rows``: ``(path, init type, returned type)`` of each leaf that differs,
    the types as ``jax.typeof`` gives them; the fix is for the first."""
    body = listing(
        [(p, f"init {short_type(a)}, returned {short_type(b)}") for p, a, b in rows]
    )
    return TypeError(
        f"{call}: the carry returned by `f` must have the same structure, shapes and "
        f"dtypes as `init`, but it differs:\n{body}\nFix: {_carry_fix(*rows[0])}."
    )


# Kinds of dtype, each holding the values of the ones before it.
_KINDS = (np.bool_, np.integer, np.floating, np.complexfloating)


def _kind(dtype: Any) -> int | None:
    """The index in ``_KINDS`` of ``dtype``'s kind; None for PRNG keys and other
    dtypes that are not numbers."""
    for i, kind in enumerate(_KINDS):
        if jax.dtypes.issubdtype(dtype, kind):
            return i
    return None


def _carry_fix(path: str, init: Any, new: Any) -> str:
    """What to do when ``f`` returns ``new`` where ``init`` was: keep the shape; for
    a value of a wider kind (an int becoming a float, a float a complex number)
    start with that kind, since casting back would lose what ``f`` computes; else
    cast back (a float32 carry ``f`` returns as float16 or float64)."""
    if init.shape != new.shape:
        return (
            f"keep {path} at shape {tuple(init.shape)} (a carry cannot change shape; "
            "preallocate and write with `.at[i].set`)"
        )
    was, now = _kind(init.dtype), _kind(new.dtype)
    if was is None or now is None:
        return f"return {path} as {short_type(init)}, the type of `init`"
    old_name, new_name = np.dtype(init.dtype).name, np.dtype(new.dtype).name
    if now <= was:
        return f"cast it back: `new.astype(jnp.{old_name})`"
    if path == "carry":
        how = f"`init.astype(jnp.{new_name})`"
    else:
        how = f"`.astype(jnp.{new_name})` on that leaf of `init`"
    if _KINDS[was] is np.bool_:
        lost = "all but whether it is nonzero"
    elif _KINDS[now] is np.complexfloating:
        lost = "its imaginary part"
    else:
        lost = "its fractional part"
    return (
        f"start {path} as {new_name}, the dtype `f` returns ({how}); casting the "
        f"new value back to {old_name} would drop {lost}"
    )


def not_numeric(call: str, rows: list[tuple[str, Any]]) -> TypeError:
    """``rows``: ``(path, array)`` of arrays JAX cannot hold (strings, objects)."""
    body = listing([(path, f"{x.dtype} {list(x.shape)}") for path, x in rows])
    return TypeError(
        f"{call}: these arrays cannot be JAX arrays (strings, objects or dates):\n"
        f"{body}\nFix: encode them as numbers (strings as integer ids), or keep "
        "them out of `init` and `xs`: a Python str or tuple in the carry is a "
        "static leaf, passed through unchanged."
    )


def carry_structure(call: str, path: str, init_desc: str, out_desc: str) -> TypeError:
    return TypeError(
        f"{call}: the carry returned by `f` must have the same pytree structure as "
        f"`init`, but {path} differs:\n  init:     {init_desc}\n  returned: "
        f"{out_desc}\nFix: return "
        "a carry built like `init` (same containers, keys and fields); keep values "
        "that change kind out of the carry."
    )


def carry_leaf_not_array(call: str, path: str, before: Any, after: Any) -> TypeError:
    return TypeError(
        f"{call}: {path} is carried (in `init` it is {short_type(before)}), but "
        f"`f` returns {short_type(after)} there, not an array.\nFix: return an "
        "array there (e.g. jnp.asarray(...)); keep values that are not arrays, "
        "such as strings and functions, out of the carry or unchanged as in `init`."
    )


def nnx_graph_changed(
    call: str, nodes: str, added: list[str], removed: list[str]
) -> TypeError:
    what = added_removed(
        added, removed, "the same Variables, with a type or submodule changed"
    )
    return TypeError(
        f"{call}: the NNX objects {nodes} in the carry came back from `f` with a "
        f"different graph ({what}).\nFix: do not create or delete Variables inside "
        "`f`. Values stored with `Module.sow` are new Variables: call the model "
        "through `nnx.capture(model, nnx.Intermediate)(x)` and return what it "
        "captures in `y`, or remove them with `nnx.pop(model, nnx.Intermediate)` "
        "before returning the carry."
    )


def nnx_carry_moved(call: str, passed: str, returned: str) -> TypeError:
    return TypeError(
        f"{call}: `f` returns the carry's NNX object passed as {passed} at "
        f"{returned}. Each place of the carry keeps its own state, written back "
        "after the scan into the object passed there: the objects would end with "
        "each other's states, where a Python loop moves the objects themselves.\n"
        "Fix: return each NNX object at the place it was passed. To swap the roles "
        "of two objects of one structure, swap their states in place: `sa, sb = "
        "nnx.clone(nnx.state(a)), nnx.clone(nnx.state(b)); nnx.update(a, sb); "
        "nnx.update(b, sa)`."
    )


def shared_ref() -> ValueError:
    return ValueError(
        "scanax: two different Variables of the model hold the same array ref "
        "(one attached to another with `set_raw_value`); Flax cannot copy such a "
        "model, and scanax carries a model's refs as the arrays they hold, one "
        "per Variable.\nFix: share the Variable itself (assign the same "
        "`nnx.Param` to both attributes, as tied weights are), or give each "
        "Variable a ref of its own."
    )


def ref_not_writable(
    names: list[str], paths: list[tuple], kind: str, call: str = "scanax"
) -> RefNotWritable:
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return RefNotWritable(
        f"{call}: the array refs of {shown} are closed over by a function that "
        f"`jax.vmap` or `jax.grad` transforms, and JAX cannot write a {kind} value "
        "into a ref it does not transform. Nothing was written into them.\nFix: "
        "pass the model in as an argument: to `nnx.vmap`/`nnx.grad` (or to "
        "`jax.vmap`/`jax.grad` and return it), or call it in eval mode there.",
        paths,
        kind,
    )


def nnx_carried_and_in_xs(call: str, name: str) -> TypeError:
    return TypeError(
        f"{call}: {name} shares Variables with an NNX object of the carry, and "
        f"`f` changes them through the carry, while {name} holds them as they "
        "were before the scan, where a Python loop sees each step's values.\n"
        "Fix: read the object from the carry only; to use its values from before "
        "the scan, pass a copy in xs: nnx.clone(...)."
    )


def nnx_ref_written_around(call: str, names: list[str]) -> NNXMutation:
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return NNXMutation(
        f"{call}: `f` writes {shown} through its closure (the object you passed "
        "as the carry, not the one `f` is given), but the scan carries it: the "
        "carry's values would be written back at the end over what `f` wrote "
        "there. Nothing was run and nothing was changed.\nFix: write through "
        "the carry `f` is given (`model, y = carry`), or do not carry the object "
        "and let `f` use its array refs through the closure."
    )


def nnx_made_outside(call: str, names: list[str]) -> TypeError:
    """NNX objects in the carry from outside the trace now running: NNX forbids
    writing them there, so the scan could not update them in place."""
    one = len(names) == 1
    what, was, they, them = (
        ("object", "was", "it", "it") if one else ("objects", "were", "they", "them")
    )
    args = "an argument" if one else "arguments"
    return TypeError(
        f"{call}: the NNX {what} {', '.join(names)} {was} made outside the function "
        f"being traced (by `jax.jit`, `jax.grad`, `jax.vmap`...), so {they} cannot "
        "be updated in place: NNX lets only the trace that made a Variable write "
        "it. Nothing was run and nothing was changed.\n"
        f"Fix: pass {them} in as {args}: to `nnx.jit` (or `nnx.grad`, `nnx.vmap`), "
        "which writes the changes back to your objects, or to `jax.jit`, and return "
        f"{them} from the jitted function (`jax.jit` gives the function copies of "
        "your objects)."
    )


def static_changed(call: str, path: str, before: Any, after: Any) -> TypeError:
    return TypeError(
        f"{call}: carry{path} is a non-array (static) value, which must come back "
        f"unchanged from `f`, but it was {before!r} and `f` returned {after!r}.\n"
        "Fix: keep non-array values fixed inside the loop (pass them in `xs` with "
        "in_axes=None), or make the value an array so it can change."
    )


def bad_output_leaf(call: str, path: str, leaf: Any) -> TypeError:
    return TypeError(
        f"{call}: every leaf of the per-step output `y` must be an array, but "
        f"y{path} is a {short_type(leaf)}.\nFix: return arrays in `y` (or drop "
        "the value; put constants outside the loop)."
    )


def nnx_input_mutated(
    call: str, path: str, names: list[str], scanned: bool
) -> NNXMutation:
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    how = "scanned (a slice per step)" if scanned else "broadcast (in_axes None)"
    fix = "put the object in the carry, e.g. `scanax.scan(f, (carry, obj), xs)`, "
    fix += "and return it from `f`" + (
        "; for a stack of objects, carry the part that changes (an `nnx.Rngs`, a "
        "counter) instead"
        if scanned
        else ""
    )
    return NNXMutation(
        f"{call}: `f` changed the NNX object {path}, but it is {how}, an input of "
        f"the step, so the change would be dropped after the step. Changed: "
        f"{shown}.\nFix: {fix}."
    )


def nnx_closure_mutation(call: str, names: list[str], err: Exception) -> NNXMutation:
    found = (
        "NNX objects `f` reaches through its closure or globals: " + ", ".join(names)
        if names
        else "an NNX object `f` reaches through its closure or globals"
    )
    return NNXMutation(
        f"{call}: `f` changes {found}. A scan cannot change objects it does not "
        "carry, so nothing was run and nothing was changed.\nFix: carry them and "
        "return them from `f`:\n"
        "    def step(carry, batch):\n"
        "        model, optimizer = carry\n"
        "        ...\n"
        "        return (model, optimizer), loss\n"
        "    (model, optimizer), losses = scanax.scan(step, (model, optimizer), "
        "batches)\n"
        "After the scan, the objects you passed are updated in place."
        f"\n(NNX said: {str(err).splitlines()[0]})"
    )


def no_attribute(name: str) -> AttributeError:
    return AttributeError(f"module 'scanax' has no attribute {name!r}")


def seq_lengths_range(call: str, index: tuple, value: int, t: int) -> ValueError:
    at = f"[{', '.join(map(str, index))}]"
    return ValueError(
        f"{call}: seq_lengths{at} is {value}, outside 0..{t} (the sequences "
        f"have {t} steps): a length above {t} would run as {t}, a negative one "
        "as 0, hiding an off-by-one in the lengths.\nFix: pass each sequence's "
        f"number of valid steps, 0 to {t} (e.g. `jnp.clip(lengths, 0, {t})` if "
        "longer ones are truncated on purpose)."
    )
