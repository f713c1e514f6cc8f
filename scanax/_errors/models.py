"""Messages of ``scanax.fit``'s model kinds (``_models``): an unsupported
``(model, optimizer)`` pair, an ``opt_state`` that does not fit, a TrainState's
updates, what ``loss_fn`` and ``eval_fn`` return, a step that changes the state's
structure."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from . import added_removed, listing, short_type
from .fit import CALL


def state_structure_changed(added: list[str], removed: list[str]) -> TypeError:
    what = added_removed(
        added,
        removed,
        "the same paths, with a Variable's type or value structure changed",
    )
    return TypeError(
        f"{CALL}: `loss_fn` changed the model's or optimizer's Variables ({what}). "
        "The state carried from step to step must keep one structure.\nFix: do "
        "not create or delete Variables in `loss_fn`. Values stored with "
        "`Module.sow` are new Variables: call the model through "
        "`nnx.capture(model, nnx.Intermediate)(x)` (return what it captures as "
        "metrics if you want it), or remove them with "
        "`nnx.pop(model, nnx.Intermediate)` before returning the loss."
    )


def batch_stats_not_updated() -> str:
    return (
        f"{CALL}: the TrainState has `batch_stats`, but `loss_fn` returns no "
        "updates for them, so they stay as they are through training. To keep "
        "the new statistics, return them as a third element: `return loss, "
        "metrics, {'batch_stats': updates['batch_stats']}` (with "
        "`apply_fn(..., mutable=['batch_stats'])`)."
    )


def state_not_returned(path: str, given_back: bool = False) -> str:
    what = (
        "returns the State it was given (or one it did not compute), not the "
        "new one the model's call made"
        if given_back
        else "returns no new State"
    )
    return (
        f"{CALL}: the model holds an eqx.nn.State at model{path}, but `loss_fn` "
        f"{what}, so its arrays (BatchNorm's running statistics) "
        "stay as they are through training (fit never trains them). To keep "
        "them, return the new State as a third element: `pred, state = "
        "jax.vmap(model, axis_name='batch', in_axes=(0, None), out_axes=(0, "
        "None))(x, state)`, then `return loss, metrics, state`."
    )


def state_without_metrics(path: str, out: tuple) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` returned a tuple of {len(out)} "
        f"({', '.join(short_type(x) for x in out)}) with the new eqx.nn.State "
        f"for model{path}; the State comes third, after the metrics.\nFix: "
        "`return loss, metrics, state` (`{}` for no metrics)."
    )


def state_metrics_type(path: str, metrics: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` returned (loss, {short_type(metrics)}, State): the "
        f"second element must be the metrics dict (the State for model{path} "
        "comes third).\nFix: `return loss, {}, state` for no metrics."
    )


def third_without_state(value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` returned a third element ({short_type(value)}), but "
        "the model holds no eqx.nn.State for it to replace (a third element is "
        "the new eqx.nn.State of a model made by `eqx.nn.make_with_state`, or a "
        "TrainState's updates).\nFix: return `loss` or `(loss, metrics)`."
    )


def state_not_a_state(path: str, value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the third element `loss_fn` returned must be the new "
        f"eqx.nn.State for model{path}, got {short_type(value)}.\nFix: return "
        "the State the model's call gave back: `return loss, metrics, state`."
    )


def state_changed(path: str, want: list, got: list) -> TypeError:
    def desc(avals):
        return ", ".join(f"{d}{list(s)}" for s, d in avals)

    return TypeError(
        f"{CALL}: the new eqx.nn.State `loss_fn` returned for model{path} changes "
        f"its structure, shapes or dtypes:\n  model{path}  {desc(want)}\n  "
        f"returned  {desc(got)}\nFix: return the State the model's call gave "
        "back, without casting it (a float16 model keeps its State's dtypes)."
    )


def states_many(paths: list[str]) -> TypeError:
    where = ", ".join(f"model{p}" for p in paths)
    return TypeError(
        f"{CALL}: the model holds {len(paths)} eqx.nn.State objects ({where}); "
        "fit threads one (`eqx.nn.make_with_state` makes one for the whole "
        "model).\nFix: pass the model with its one State, `(model, state)`."
    )


def trainstate_updates_type(updates: Any, fields: list[str]) -> TypeError:
    return TypeError(
        f"{CALL}: the third element `loss_fn` returned must be a dict of new "
        f"values for fields of the TrainState ({', '.join(fields) or 'it has none'}), "
        f"got {short_type(updates)}.\nFix: return `loss, metrics, "
        "{'batch_stats': ...}`."
    )


def trainstate_updates_field(name: Any, fields: list[str]) -> ValueError:
    return ValueError(
        f"{CALL}: `loss_fn` returned an update for {name!r}, which is not a field "
        f"the TrainState lets `loss_fn` replace ({', '.join(fields) or 'none'}; "
        "step, params and opt_state come from apply_gradients).\nFix: return "
        "updates only for fields of your TrainState subclass."
    )


def trainstate_updates_changed(name: str, old: Any, new: Any) -> TypeError:
    def desc(tree):
        return str(jtu.tree_map(short_type, tree)).replace("'", "")

    return TypeError(
        f"{CALL}: the update `loss_fn` returned for state.{name} changes its "
        f"structure, shapes or dtypes:\n  state.{name}  {desc(old)}\n  update  "
        f"{desc(new)}\nFix: return a value built like state.{name} (for linen "
        f"collections: `updates['{name}']` from apply_fn(..., mutable=...))."
    )


def loss_tuple(call: str, out: Any, name: str = "loss_fn") -> TypeError:
    return TypeError(
        f"{call}: `{name}` returned a tuple of {len(out)} "
        f"({', '.join(short_type(x) for x in out)}); expected a scalar "
        "loss or a pair (loss, metrics) with metrics a dict of arrays.\n"
        "Fix: return `loss` or `(loss, {'name': value, ...})`."
    )


def loss_not_scalar(call: str, loss: Any, name: str = "loss_fn") -> TypeError:
    if isinstance(loss, list):
        return TypeError(
            f"{call}: `{name}` returned a list of {len(loss)} "
            f"({', '.join(short_type(x) for x in loss)}); expected a scalar loss "
            "or a tuple (loss, metrics).\nFix: return a tuple: `return loss, "
            "metrics`, not `[loss, metrics]`."
        )
    if isinstance(loss, dict) and name != "loss_fn":
        names = ", ".join(repr(k) for k in loss)
        return TypeError(
            f"{call}: `{name}` returned a dict ({names}); expected a scalar loss, "
            "or a pair (loss, metrics).\nFix: return `(loss, {...metrics})`: the "
            "loss's mean over the data is the evaluation's loss (val_loss in "
            "fit), the dict's arrays its other metrics."
        )
    if isinstance(loss, dict):
        names = ", ".join(repr(k) for k in loss)
        return TypeError(
            f"{call}: `{name}` returned a dict ({names}); expected the scalar "
            "loss, or a pair (loss, metrics).\nFix: return "
            "`(out['loss'], {...other metrics})`: the first element is "
            "differentiated, the dict's arrays join the history."
        )
    if isinstance(loss, (bool, int, float)):
        fix = (
            "compute the loss from the model and the batch with JAX operations "
            "(a Python number is a constant: it has no gradient)"
        )
    elif getattr(loss, "shape", None) == () and hasattr(loss, "dtype"):
        fix = (
            "compute it in floating point (an integer loss has no gradient), "
            "e.g. cast what you count: `jnp.mean(errors.astype(jnp.float32))`"
        )
    else:
        fix = "reduce it, e.g. `jnp.mean(...)` over the batch"
    return TypeError(
        f"{call}: `{name}` must return a scalar floating-point loss, got "
        f"{short_type(loss)}.\nFix: {fix}."
    )


def metric_name_type(call: str, key: Any, name: str = "loss_fn") -> TypeError:
    by = "`loss_fn`" if name == "loss_fn" else f"`{name}`"
    return TypeError(
        f"{call}: {by} returned a metric named {key!r} ({type(key).__name__}); "
        "metric names are strings (the history's keys, log columns).\nFix: "
        f"name it with a string, e.g. `{{'metric_{key}': value}}`."
    )


def metric_not_array(
    call: str, path: str, leaf: Any, name: str = "loss_fn"
) -> TypeError:
    why, fix = "", ""
    if isinstance(leaf, (dict, list, tuple)):
        why = " (metrics is one flat dict: history keeps one array per name)"
        fix = ", one name each: `{'err/mae': ..., 'err/max': ...}`"
    by = "" if name == "loss_fn" else f" returned by `{name}`"
    return TypeError(
        f"{call}: metric metrics{path}{by} is {short_type(leaf)}, expected an array"
        f"{why}.\nFix: return jax arrays (e.g. `jnp.mean(...)`) as metrics{fix}."
    )


# The rule every metric follows (training, evaluation, a rollout's collection).
METRIC_RULE = (
    "a metric is a real number or array (bool, integer or floating) of one "
    "fixed shape, kept as such in the history, logs and evaluations"
)


def metric_complex(call: str, path: str, leaf: Any, name: str) -> TypeError:
    key = path.strip("[]'\"") or "m"
    return TypeError(
        f"{call}: metric metrics{path} returned by `{name}` is {short_type(leaf)}; "
        f"{METRIC_RULE} (a complex value would lose its imaginary part in "
        "evaluation means and logs).\nFix: return a real value, e.g. "
        f"jnp.abs(z), or two metrics: {{'{key}_re': z.real, '{key}_im': z.imag}}."
    )


def metric_not_real(call: str, path: str, leaf: Any, name: str) -> TypeError:
    return TypeError(
        f"{call}: metric metrics{path} returned by `{name}` is {short_type(leaf)}; "
        f"{METRIC_RULE}.\nFix: return numbers (jnp arrays); keep text and other "
        "objects out of the metrics."
    )


def opt_state_mismatch(detail: str) -> TypeError:
    return TypeError(
        f"{CALL}: `opt_state` does not match tx.init(params) of this model and "
        f"optimizer ({detail}).\nFix: pass the `result.optimizer` of an earlier fit "
        "with the same model structure and the same optax transformation, or drop "
        "opt_state to start from tx.init."
    )


def update_needs_more(err: TypeError) -> TypeError:
    return TypeError(
        f"{CALL}: the optimizer's update asks for arguments fit does not pass "
        f"({err}). fit passes `value=` (the step's loss) to a transform that "
        "takes extra arguments, not `grad=` and `value_fn=`, which a line search "
        "needs (optax.lbfgs() has one: it evaluates the loss at trial points).\n"
        "Fix: optax.lbfgs(learning_rate=..., linesearch=None), or another "
        "optimizer; for a line search, a loop of your own calling "
        "optax.value_and_grad_from_state and tx.update(..., value_fn=...)."
    )


def opt_state_not_optax(optimizer: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `opt_state` is for an Equinox module or pytree trained with "
        f"an optax transformation; here the optimizer is "
        f"{short_type(optimizer)}.\nFix: drop opt_state (an "
        "nnx.Optimizer and a TrainState carry their own optimizer state)."
    )


def nnx_objects_in_optax_model(bad: list[tuple[str, str]]) -> TypeError:
    return TypeError(
        f"{CALL}: the model holds NNX objects, which an optax "
        f"transformation cannot train:\n{listing(bad)}\nFix: pass "
        "an nnx.Module with nnx.Optimizer(model, tx, wrt=nnx.Param)."
    )


def nothing_to_train(model: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the model ({short_type(model)}) has no "
        "floating-point arrays to train.\nFix: pass an Equinox module or a "
        "pytree whose parameters are floating-point jax arrays."
    )


SUPPORTED_PAIRS = (
    "  (nnx.Module, nnx.Optimizer)   e.g. nnx.Optimizer(model, tx, wrt=nnx.Param)\n"
    "  (Equinox module or pytree of arrays, optax.GradientTransformation)\n"
    "  (flax.training.train_state.TrainState, None)   its own `tx` is used"
)
_PAIR_FIXES = {
    "trainstate_with_optimizer": "a TrainState carries its own optimizer (`tx`)."
    "\nFix: pass optimizer=None.",
    "nnx_without_optimizer": "Fix: pass nnx.Optimizer(model, tx, wrt=nnx.Param) as "
    "the optimizer.",
    "optimizer_without_nnx": "Fix: pass the nnx.Module that the nnx.Optimizer was "
    "built for.",
    "swapped": "The model and the optimizer are swapped.\nFix: "
    "fit(model, optimizer, loss_fn, data, ...).",
    "uncalled": "The optimizer is optax's function, not called.\nFix: call it "
    "with its settings, e.g. `optax.adam(1e-3)`.",
    "other": "Fix: pass one of the supported pairs.",
}


def bad_pair(model: Any, optimizer: Any, why: str) -> TypeError:
    """``why``: one of ``_PAIR_FIXES``' keys."""
    return TypeError(
        f"{CALL}: unsupported (model, optimizer) pair "
        f"({short_type(model)}, {short_type(optimizer)}); the "
        f"supported pairs are:\n{SUPPORTED_PAIRS}\n{_PAIR_FIXES[why]}"
    )


def metric_name_reserved(call: str, name: str) -> ValueError:
    return ValueError(
        f"{call}: `loss_fn` (or `eval_fn`) returns a metric named {name!r}, a name "
        "the history keeps for itself ('loss', 'step', '..._step'; for loss_fn "
        "also 'val_...' and 'rollout_...', the evaluations' and a Rollout's).\n"
        f"Fix: rename it, e.g. {name!r} -> 'my_{name}'."
    )


def wrt_chooses_nothing(wrt: Any, held: dict) -> ValueError:
    kinds = ", ".join(f"{name} ({n})" for name, n in held.items()) or "none"
    return ValueError(
        f"{CALL}: the optimizer's `wrt` ({wrt!r}) chooses none of the model's "
        "floating-point Variables, so training would change nothing; the model "
        f"holds: {kinds}.\nFix: hold the weights as `nnx.Param` (as nnx.Linear "
        "and the other layers do), or pass `nnx.Optimizer(model, tx, wrt=...)` "
        "the Variable type they have."
    )


def loss_reads_no_parameter(call: str, what: str, cut: bool, nnx: bool) -> ValueError:
    if cut:
        cause = (
            "The cause: the loss is computed under `jax.lax.stop_gradient`, "
            "which no gradient passes.\nFix: stop the gradient of a target or a "
            "part of the loss only, not of the whole loss."
        )
    else:
        cause = (
            "The usual cause: `loss_fn` reads a model other than the one it is "
            "passed (one from a closure, a `functools.partial(loss, model)`, "
            "`self.model`); fit passes `loss_fn` the model being trained, as "
            "traced values, at every step.\nFix: compute the loss from `loss_fn`'s "
            "first argument, e.g. `def loss_fn(model, batch): return "
            "jnp.mean((model(batch['x']) - batch['y']) ** 2)`."
        )
        if nnx:
            cause += (
                " If it does, make the optimizer's `wrt` choose Variables the loss "
                "reads (`nnx.Param`; BatchNorm's `nnx.BatchStat` are not read in "
                "training)."
            )
    return ValueError(
        f"{call}: the loss does not depend on any of {what}: its gradient is "
        f"zero, and training would change nothing.\n{cause}"
    )
