"""Messages of ``scanax.Rollout``'s errors (as ``fit``'s data)."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from . import short_type

CALL = "scanax.Rollout"
_FORM = "collect(model, carry, key) -> (batch, carry) or (batch, carry, metrics)"


def not_callable(name: str, fn: Any) -> TypeError:
    form = _FORM if name == "collect" else "init(key) -> carry"
    return TypeError(
        f"{CALL}: `{name}` must be callable as {form}, got {short_type(fn)}.\n"
        "Fix: scanax.Rollout(collect, init, epochs=..., minibatches=...)."
    )


def positive(name: str, value: Any) -> TypeError | ValueError:
    kind = (
        TypeError
        if isinstance(value, bool) or not isinstance(value, int)
        else ValueError
    )
    return kind(
        f"{CALL}: `{name}` must be a positive int, got {value!r}.\nFix: pass "
        f"{name}=1 or more."
    )


def without_key() -> TypeError:
    return TypeError(
        "scanax.fit: data=scanax.Rollout(...) needs `key`: `init` and every "
        "collection get keys derived from it.\nFix: pass key=jax.random.key(0) "
        "(any key)."
    )


def option(name: str) -> ValueError:
    return ValueError(
        f"scanax.fit: `{name}` is not supported with data=scanax.Rollout(...) "
        "yet.\nFix: drop it (a rollout's minibatches are its own: "
        "Rollout(minibatches=...))."
    )


def batch_size_given(batch_size: Any) -> TypeError:
    return TypeError(
        f"scanax.fit: batch_size={batch_size!r} is given with "
        "data=scanax.Rollout(...), whose batches are what `collect` returns.\n"
        "Fix: drop batch_size; a step's minibatch is the collected batch's "
        "leading axis divided by Rollout(minibatches=...)."
    )


def output(out: Any) -> TypeError:
    got = f"a tuple of {len(out)}" if isinstance(out, tuple) else short_type(out)
    return TypeError(
        f"{CALL}: `collect` must return (batch, carry) or (batch, carry, "
        f"metrics), got {got}.\nFix: return a tuple: {_FORM}."
    )


def batch_empty(value: Any) -> ValueError:
    rows = [
        f"  {jtu.keystr(p) or 'batch'}: {short_type(x)}"
        for p, x in jtu.tree_flatten_with_path(value)[0]
    ]
    return ValueError(
        f"{CALL}: the batch `collect` returns has no examples (a leading axis "
        "of 0):\n" + "\n".join(rows) + "\nThere is nothing to train on: a mean "
        "loss of it is NaN, a summed one 0.\nFix: collect at least `minibatches` "
        "examples (the number of steps or environments collected is not 0)."
    )


def metrics(value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the third value `collect` returns must be a dict of "
        f"metrics, got {short_type(value)}.\nFix: return (batch, carry, "
        "{'return': mean_return}) or just (batch, carry)."
    )


def init_leaf(path: str, value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `init` returned {short_type(value)} at carry{path}; the carry "
        "is a pytree of arrays the compiled loop keeps between collections.\n"
        "Fix: return arrays (jnp.asarray), and keep other values out of the "
        "carry (close over them in `collect`)."
    )


def batch(value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the batch `collect` returns must be a non-empty pytree of "
        f"arrays with a leading example axis, got {short_type(value)}.\nFix: "
        "return e.g. (obs[T * envs, ...], actions[T * envs], advantages[T * envs]) "
        "(reshape a [T, envs, ...] rollout to one leading axis)."
    )


def batch_sizes(value: Any, minibatches: int) -> ValueError:
    rows = [
        f"  {jtu.keystr(p) or 'batch'}: {short_type(x)}"
        for p, x in jtu.tree_flatten_with_path(value)[0]
    ]
    return ValueError(
        f"{CALL}: the batch `collect` returns must have one leading size that "
        f"minibatches={minibatches} divides; found:\n" + "\n".join(rows) + "\n"
        "Fix: make every leaf's leading axis the same number of examples, a "
        "multiple of `minibatches` (or change minibatches)."
    )


def carry_structure(old: Any, new: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the carry `collect` returns has another structure than the "
        f"one it was given.\n  given:    {old}\n  returned: {new}\nFix: return "
        "the carry with the structure `init` built (the same containers and "
        "leaves)."
    )


def carry_leaf(path: str, old: Any, new: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the carry `collect` returns changed carry{path} from "
        f"{short_type(old)} to {short_type(new)}.\nFix: keep each carry leaf's "
        "shape and dtype (cast with .astype(old.dtype))."
    )


def members(kept: Any, now: Any) -> ValueError:
    def what(n: Any) -> str:
        return "one model" if n is None else f"a population of {n}"

    return ValueError(
        f"{CALL}: this Rollout's state is from a fit of {what(kept)}; this fit "
        f"trains {what(now)}.\nFix: call rollout.reset() to start from `init` "
        "again, or use a new scanax.Rollout."
    )


def state_changed(keys: Any = None) -> TypeError:
    why = "`collect` or `init` now make other shapes"
    if keys is not None:
        why = (
            f"its key is {keys[0]} and this fit's key is {keys[1]} (a raw "
            "jax.random.PRNGKey and a typed jax.random.key differ)"
        )
    return TypeError(
        f"{CALL}: this Rollout's state (kept from its last fit) does not fit "
        f"this fit: {why}.\nFix: pass the same kind of key as before, or call "
        "rollout.reset() to start from `init` again (or use a new "
        "scanax.Rollout)."
    )


def metric_name(name: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `collect` returns a metric named {name!r}; the history keeps "
        "each as 'rollout_<name>' at 'rollout_step', so a name must be a string "
        "that is not 'step', does not end in '_step' and does not start with "
        "'rollout_'.\nFix: rename it, e.g. 'episode_return'."
    )


def arity(name: str, fn: Any, n: int) -> TypeError:
    form = _FORM if name == "collect" else "init(key) -> carry"
    return TypeError(
        f"{CALL}: `{name}` cannot be called with {n} argument(s) as {form}.\n"
        f"Fix: give {getattr(fn, '__name__', name)} that signature (close over "
        "anything else, e.g. with functools.partial)."
    )


def batch_leaf(path: str, leaf: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the batch `collect` returns has batch{path} = "
        f"{short_type(leaf)}; every leaf must be an array with a leading "
        "example axis.\nFix: give it one (e.g. jnp.broadcast_to(x, (n,)) for a "
        "per-batch value), or close over it in loss_fn instead."
    )


def epochs_with_rollout(epochs: Any) -> TypeError:
    return TypeError(
        f"scanax.fit: epochs={epochs} counts passes over array data; a Rollout "
        "has no fixed data to pass over.\nFix: pass steps= (optimizer steps), "
        "and Rollout(epochs=..., minibatches=...) for the passes over each "
        "collected batch."
    )


def state_elsewhere(kept: int, start: int) -> str:
    return (
        f"{CALL}: this Rollout's state (its environments, batch and key) was "
        f"left at step {kept} by its last fit; this fit starts at step {start}, "
        "so it continues that state with another model's steps (not what a run "
        "from `key` gives). Call rollout.reset() (or use a new scanax.Rollout) "
        "to start from `init`."
    )
