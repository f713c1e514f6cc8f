"""Messages of ``scanax.evaluate`` and ``scanax.predict``: their functions, data,
batch size, key, model and mesh, and what ``predict``'s function returns."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from . import keys, listing, short_type

CALL = "scanax.evaluate"
PREDICT = "scanax.predict"


def _forms(call: str, name: str, population: bool) -> str:
    return keys.forms(name, population)


def fn_not_callable(call: str, name: str, fn: Any, population: bool) -> TypeError:
    return TypeError(
        f"{call}: `{name}` must be a function, called as "
        f"{_forms(call, name, population)}, got {short_type(fn)}.\nFix: pass the "
        f"function second: {call}(model, {name}, data)."
    )


def data_missing(call: str, name: str, fn: Any) -> TypeError:
    """``evaluate(model, data)``/``predict(model, x)``: the function left out."""
    if callable(fn):
        return TypeError(
            f"{call}: `data` is missing.\nFix: {call}(model, {name}, data), with "
            "data the whole dataset as arrays with a leading example axis, e.g. "
            "(x, y)."
        )
    example = (
        "lambda model, x: model(x), x)"
        if call == PREDICT
        else "eval_fn, (x, y)), with eval_fn(model, batch) returning the loss or "
        "(loss, metrics)"
    )
    return TypeError(
        f"{call} takes (model, {name}, data): got {short_type(fn)} second and "
        f"no data; `{name}` is the function {call} applies to each batch.\n"
        f"Fix: {call}(model, {example}."
    )


def data_not_arrays(call: str, data: Any) -> TypeError:
    if isinstance(data, list):
        got = "a list (fit takes a list as a sequence of batches)"
        fix = "pass a tuple or a dict of arrays, e.g. (x, y)"
    else:
        bad = [
            (jtu.keystr(p), short_type(x))
            for p, x in jtu.tree_flatten_with_path(data)[0]
            if not hasattr(x, "shape")
        ]
        got = (
            "nothing (no arrays)"
            if not jtu.tree_leaves(data)
            else "leaves that are not arrays:\n" + listing(bad)
            if bad
            else short_type(data)
        )
        fix = "pass the whole dataset as arrays with a leading example axis"
    return TypeError(
        f"{call}: `data` must be a pytree of arrays sharing a leading example "
        f"axis, got {got}.\nFix: {fix} (an iterable of batches is not supported)."
    )


def data_leading_axes(call: str, leaves: list[tuple[Any, Any]]) -> ValueError:
    body = listing(
        [
            (
                f"data{jtu.keystr(p)}",
                f"{short_type(x)}: {x.shape[0] if x.ndim else 'no leading axis'}",
            )
            for p, x in leaves
        ]
    )
    return ValueError(
        f"{call}: the arrays in `data` must share their leading (example) axis, "
        f"found:\n{body}\nFix: give every leaf the same number of examples along "
        "axis 0."
    )


def data_empty(call: str, data: Any) -> ValueError:
    shapes = ", ".join(short_type(x) for x in jtu.tree_leaves(data))
    return ValueError(
        f"{call}: `data` has no examples ({shapes}).\nFix: pass at least one "
        "example along axis 0."
    )


def batch_size_type(call: str, value: Any) -> TypeError:
    return TypeError(
        f"{call}: `batch_size` must be a positive int or None, got "
        f"{short_type(value)}.\nFix: pass the number of examples per batch, e.g. "
        "batch_size=256 (None: 1024, or every example when there are fewer)."
    )


def batch_size_not_positive(call: str, value: int) -> ValueError:
    return ValueError(
        f"{call}: `batch_size` must be positive, got {value}.\nFix: pass the "
        "number of examples per batch (1 or more), or None for the default."
    )


def key_type(call: str, key: Any) -> TypeError:
    return TypeError(
        f"{call}: `key` must be one JAX random key, as jax.random.key(seed) makes "
        f"(a typed key array of shape ()) or a legacy uint32[2] key, got "
        f"{short_type(key)}.\nFix: pass key=jax.random.key(seed)."
    )


def model_type(call: str, model: Any) -> TypeError:
    return TypeError(
        f"{call}: `model` holds no arrays ({short_type(model)}); expected an NNX "
        "module, an Equinox module or pytree of arrays, a flax TrainState, or a "
        "scanax.Population.\nFix: pass the model itself (for a fit result: "
        "result.model; for a population's, the population)."
    )


def optimizer_as_model(call: str) -> TypeError:
    return TypeError(
        f"{call}: `model` is an nnx.Optimizer, which holds the model it trains "
        "and its optimizer state; what is evaluated is the model.\nFix: pass "
        "the model itself, the one given to nnx.Optimizer(model, tx, wrt=...)."
    )


def own_rngs_drawn(call: str | None, streams: list[str]) -> str:
    who = f"{call}: the function evaluated" if call else "An evaluation's function"
    names = ", ".join(f"model.{s}" for s in streams)
    return (
        f"{who} draws random numbers from the model's own RNG stream ({names}) "
        "in eval mode (or moves it: rngs.fork()). Every batch is evaluated on a "
        "copy of the model as it was passed in, so if those numbers change the "
        "result, each batch repeats the same ones.\nFix: take a key, "
        "fn(model, batch, key) (evaluate and predict with key=...; fit's Eval "
        "when fit has key=...), and reseed from it before drawing, e.g. "
        "nnx.reseed(model, noise=key): each batch gets its own key "
        "(fold_in(key, j))."
    )


def own_rngs_drawn_in_collect(streams: list[str]) -> str:
    names = ", ".join(f"model.{s}" for s in streams)
    return (
        "scanax.fit: Rollout's `collect` draws random numbers from the model's "
        f"own RNG stream ({names}) (or moves it: rngs.fork()). collect is called "
        "on a copy of the model in eval mode, so that stream never advances: "
        "every collection draws the same numbers.\nFix: draw from collect's "
        "`key` argument, e.g. jax.random.categorical(key, logits), or reseed "
        "from it first: nnx.reseed(model, action=key) (naming your stream)."
    )


def mesh_type(call: str, mesh: Any) -> TypeError:
    return TypeError(
        f"{call}: `mesh` must be a jax.sharding.Mesh or None, got "
        f"{short_type(mesh)}.\nFix: pass jax.make_mesh((n,), ('data',)) or "
        "leave it out."
    )


def mesh_axis(call: str, mesh: Any) -> ValueError:
    return ValueError(
        f"{call}: `mesh` has axes {tuple(mesh.axis_names)}, but no 'data' axis to "
        "split the batches over.\nFix: name the batch axis 'data', e.g. "
        "jax.make_mesh((n,), ('data',))."
    )


def batch_not_divisible(
    call: str, batch_size: int, n: int, given: Any = None
) -> ValueError:
    """``batch_size``: the batch size used; ``given``: the argument."""
    if given is None:
        what = f"`batch_size` (by default {batch_size}, the dataset's size)"
    elif given != batch_size:
        what = f"`batch_size` ({batch_size}, the dataset's size: {given} is more)"
    else:
        what = f"`batch_size` ({batch_size})"
    return ValueError(
        f"{call}: {what} must be divisible by the mesh's 'data' axis ({n} "
        "devices), to split each batch evenly.\nFix: pass a batch_size that is "
        f"a multiple of {n}, at most the number of examples."
    )


def mesh_with_population(call: str) -> ValueError:
    return ValueError(
        f"{call}: `mesh` is not supported for a scanax.Population yet (its "
        "members are evaluated on one device).\nFix: leave `mesh` out, or "
        "evaluate the members one by one: pop.member(i)[0]."
    )


def output_not_batched(path: str, leaf: Any, batch_size: int) -> TypeError:
    return TypeError(
        f"{PREDICT}: `fn` must return arrays with a leading batch axis (one row "
        f"per example of the batch, {batch_size} here), but out{path} is "
        f"{short_type(leaf)}.\nFix: return per-example outputs, e.g. model(x); "
        "reduce over the dataset with scanax.evaluate instead."
    )


def ratio_part(part: str, value: Any) -> TypeError:
    complex_ = "complex" in short_type(value) or isinstance(value, complex)
    fix = (
        "take a real value first (jnp.abs, .real)"
        if complex_
        else "pass counts or sums as arrays, e.g. scanax.Ratio(jnp.sum(hits), "
        "jnp.sum(mask))"
    )
    return TypeError(
        f"scanax.Ratio: `{part}` must be a real array or number (bool, integer or "
        f"floating), got {short_type(value)}.\nFix: {fix}."
    )


def ratio_shapes(num: Any, den: Any) -> ValueError:
    return ValueError(
        f"scanax.Ratio: the shapes of `num` ({short_type(num)}) and `den` "
        f"({short_type(den)}) do not broadcast together; the metric is "
        "num / den element by element.\nFix: give them the same shape (a scalar "
        "den broadcasts: one denominator for every element)."
    )


def metric_shape_varies(
    call: str, name: str, rows: list[tuple[str, str, str]], sizes: tuple[int, int]
) -> ValueError:
    body = listing(
        [
            (f"metrics{path}", f"{a} (batch of {sizes[0]}), {b} (batch of {sizes[1]})")
            for path, a, b in rows
        ]
    )
    return ValueError(
        f"{call}: `{name}` returns metrics whose shape depends on the batch "
        f"size:\n{body}\nA metric is a summary of the batch (a mean, a count, "
        "one value per class), of one fixed shape; a per-example value cannot be "
        "averaged over the dataset.\nFix: reduce it over the batch (jnp.mean(..., "
        "axis=0)); for per-example outputs, use scanax.predict."
    )


def fn_read_the_model(call: str, name: str, reads: str) -> TypeError:
    """``name`` (an evaluation's or prediction's function) reads the NNX model
    as ``reads`` from outside, and calling it changed that model's state."""
    return TypeError(
        f"{call}: `{name}` reads the model as `{reads}` from outside (its closure "
        "or globals), not as its first argument. That is your model as it is, not "
        f"the copy in eval mode that {call} passes, and calling it changed its "
        "state (a Dropout's random count, BatchNorm statistics) inside the compiled "
        f"program, which NNX refuses.\nFix: use the argument, def {name}(model, "
        f"batch): ... model(x) ... (not `{reads}`)."
    )


def fn_failed(
    call: str, name: str, data: str, batch: str, err: Exception, hp: str | None = None
) -> Exception:
    """A ``TypeError`` (a ``ValueError`` for one): ``name`` failed on a batch
    (``hp``: the parameter a population member's hyperparameters go to)."""
    default = (
        " (the default eval_fn is loss_fn: its batches are built like the training "
        "batches)"
        if call == "scanax.fit" and data == "eval_data" and name == "loss_fn"
        else ""
    )
    message = (
        f"{call}: `{name}` raised {type(err).__name__} while it was traced on a "
        f"batch of `{data}`, before anything ran:\n  {err}\nA batch of `{data}` "
        f"is {batch}.\nFix: if `{name}` reads another structure or other feature "
        f"shapes{default}, pass `{data}` built like that; else the error is in "
        f"`{name}` itself (see the traceback above)."
    )
    if hp is not None:
        message += (
            f"\n(For a population, `{name}`'s third parameter `{hp}` gets the "
            "member's hyperparameters, a dict; the key goes fourth, or third "
            "under the name key, rng or rngs.)"
        )
    return ValueError(message) if isinstance(err, ValueError) else TypeError(message)
