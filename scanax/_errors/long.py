"""Messages of the long-scan options' errors: ``keep_every``/``keep``, ``remat``,
``progress`` and ``scanax.scan_until``'s ``until``."""

from __future__ import annotations

from typing import Any

from . import listing, short_type

UNTIL = "scanax.scan_until"


def keep_every_type(call: str, keep_every: Any) -> TypeError:
    return TypeError(
        f"{call}: `keep_every` must be a positive int, got "
        f"{type(keep_every).__name__} {keep_every!r}.\nFix: pass e.g. "
        "keep_every=10 to keep the output of every 10th step (1 keeps all)."
    )


def keep_every_value(call: str, keep_every: int) -> ValueError:
    return ValueError(
        f"{call}: `keep_every` must be a positive int, got {keep_every}.\n"
        "Fix: pass e.g. keep_every=10 to keep the output of every 10th step "
        "(1 keeps all)."
    )


def bad_keep(call: str, keep: Any) -> ValueError:
    return ValueError(
        f'{call}: `keep` must be "all", "last", "sum", "mean" or a '
        f"function fn(acc, y) -> acc, got {keep!r}.\nFix: pass e.g. "
        'keep="mean" for the mean output, or keep=jnp.maximum for the running '
        "maximum."
    )


def nothing_kept(call: str, name: str, length: int, keep_every: int) -> ValueError:
    return ValueError(
        f"{call}: keep={name!r} needs at least one kept output, but the scan has "
        f"{length} steps and keep_every={keep_every} keeps {length // keep_every}.\n"
        'Fix: run at least keep_every steps, or use keep="all" or keep="sum".'
    )


def keep_fn_output(out: Any, leaf: Any) -> TypeError:
    return TypeError(
        "scanax.scan: the `keep` function must return an accumulator of "
        f"the same shape and dtype as the output leaf, {leaf.dtype.name}"
        f"{list(leaf.shape)}, got {short_type(out)}.\nFix: make "
        "fn(acc, y) return an array like `y`, e.g. keep=jnp.maximum."
    )


def remat_string(call: str, remat: Any) -> ValueError:
    return ValueError(
        f'{call}: `remat` must be False, True, "sqrt" or a '
        f"jax.checkpoint_policies policy, got the string {remat!r}.\nFix: pass "
        'remat="sqrt" for O(√T) gradient memory, or remat=True to checkpoint '
        "each step."
    )


def remat_type(call: str, remat: Any) -> TypeError:
    return TypeError(
        f'{call}: `remat` must be False, True, "sqrt" or a '
        f"jax.checkpoint_policies policy (a callable), got "
        f"{type(remat).__name__} {remat!r}.\nFix: pass remat=True, "
        'remat="sqrt" or e.g. remat=jax.checkpoint_policies.dots_saveable.'
    )


def remat_factory(call: str, name: str) -> TypeError:
    return TypeError(
        f"{call}: `remat` is jax.checkpoint_policies.{name}, which makes a "
        "policy from its arguments, not a policy.\nFix: call it, e.g. "
        f"remat=jax.checkpoint_policies.{name}(...) (save_only_these_names("
        '"attn_out") keeps the values named with jax.ad_checkpoint.'
        "checkpoint_name)."
    )


def until_not_callable(until: Any) -> TypeError:
    return TypeError(
        f"{UNTIL}: `until` must be a function until(carry) -> bool, got "
        f"{short_type(until)}.\nFix: pass e.g. "
        "until=lambda carry: carry[0] < 1e-6."
    )


def until_arity(signature: str) -> TypeError:
    return TypeError(
        f"{UNTIL}: `until` is called with the carry alone, until(carry), but it "
        f"is until{signature}.\nFix: take the carry only, e.g. until=lambda "
        "carry: carry[0] < 1e-6 (what it needs of a step's input, the body puts "
        "in the carry)."
    )


def keep_arity(call: str, signature: str) -> TypeError:
    return TypeError(
        f"{call}: the `keep` function is called as fn(acc, y), the accumulator "
        f"and a step's output, but it is fn{signature}.\nFix: take two "
        "arguments, e.g. keep=jnp.maximum or keep=lambda acc, y: acc + y**2."
    )


def until_not_bool(out: Any) -> TypeError:
    got = short_type(out) if out is not None else "a non-array value"
    return TypeError(
        f"{UNTIL}: `until(carry)` must return a scalar bool (bool[]), got "
        f"{got}.\nFix: return one boolean per scan, e.g. "
        "`until=lambda c: jnp.all(jnp.abs(c.delta) < 1e-6)` (reduce arrays "
        "with jnp.all/jnp.any, compare numbers with <, >, ==)."
    )


def until_second_order() -> TypeError:
    return TypeError(
        f"{UNTIL}: its derivatives are first order, and a derivative of a "
        "derivative reached it (jax.hessian, jax.jacfwd(jax.grad(...)), "
        "jax.grad(jax.grad(...)), a jvp of a gradient).\nFix: for second-order "
        "derivatives run the loop as a masked scanax.scan over all `length` steps "
        "(`new = jnp.where(done, carry, step(carry))`, with `done` carried), "
        "which costs every step; first derivatives of scan_until (grad, jvp, "
        "vmap) cost only the steps taken."
    )


def until_invariant_closure(axes: tuple, found: list[tuple[str, tuple]]) -> TypeError:
    rows = listing([(t, f"varies over {v}" if v else "invariant") for t, v in found])
    return TypeError(
        f"{UNTIL}: inside jax.shard_map each shard stops at its own step, and "
        "the derivative with respect to a value that `f` closes over (or a "
        "broadcast input, in_axes=None) must vary over the loop's manual axes "
        f"{axes}; these do not:\n{rows}\nDifferentiating one would take a psum "
        "at every step of the loop back, which the shards that stopped earlier "
        "do not run.\nFix: make it vary over the axes it does not, before `f` "
        f"reads it, inside the shard_map: `w = jax.lax.pcast(w, {axes}, "
        "to='varying')` (its gradient is then summed over the shards, as "
        "jax.grad gives it), or carry it unchanged in `init`."
    )


def until_collective(axes: tuple, names: list[str]) -> TypeError:
    return TypeError(
        f"{UNTIL}: inside jax.shard_map each shard stops at its own step, and `f` "
        f"or `until` uses a collective over the loop's manual axes {axes} "
        f"({', '.join(names)}): it would wait for the shards that stopped "
        "earlier (XLA then hangs or aborts).\nFix: compute the step and the stop "
        "from each shard's own values; for a stop all shards share (a global "
        "residual), run the loop with a fixed length, `scanax.scan` with the "
        "stop as a mask, or call scan_until outside the shard_map."
    )


def out_axes_reduced(call: str, name: str, out_axes: Any) -> ValueError:
    return ValueError(
        f"{call}: `out_axes` places the step axis of stacked outputs, but "
        f"keep={name!r} reduces the outputs, so there is no step axis; got "
        f'out_axes={out_axes!r}.\nFix: drop `out_axes`, or use keep="all" '
        "(with keep_every to thin the outputs)."
    )


def bad_progress(call: str, progress: Any) -> TypeError:
    return TypeError(
        f"{call}: `progress` must be False, True, a positive int (steps between "
        f"updates) or scanax.Progress(...), got {type(progress).__name__} "
        f"{progress!r}.\nFix: pass progress=True, progress=100 or "
        "progress=scanax.Progress(every=100, desc=...)."
    )


def bad_every(call: str, every: Any, updates: int) -> Exception:
    """``every`` of a progress bar: not an int (TypeError) or not positive."""
    cls = (
        TypeError
        if isinstance(every, bool) or not isinstance(every, int)
        else ValueError
    )
    return cls(
        f"{call}: the progress bar's `every` must be a positive int (steps between "
        f"updates) or None, got {every!r}.\nFix: pass e.g. progress=100, or "
        "progress=scanax.Progress(every=100); None picks about "
        f"{updates} updates per scan."
    )


def no_tqdm(call: str) -> ImportError:
    return ImportError(
        f"{call}: `progress=` needs tqdm, which is not installed.\nFix: `pip "
        "install tqdm` (or `pip install scanax[progress]`), or pass "
        "progress=False."
    )
