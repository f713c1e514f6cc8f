"""``scanax.fit``: many optimizer steps fused into one compiled loop per call."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .. import _caller, _progress
from .._errors import fit as errors
from . import (
    config as _fit_config,
    population as _fit_population,
    shorthand as _shorthand,
    solo as _fit_solo,
)
from .callbacks import early_stop as _early_stop
from .result import FitResult

_CALL = errors.CALL


@_caller.positional(
    4,
    lambda extra: errors.extra_positional(
        _CALL, ("model", "optimizer", "loss_fn", "data"), extra, "steps"
    ),
)
def fit(
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any],
    data: Any,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    key: Any = None,
    callbacks: Sequence[Any] = (),
    progress: bool | int | _progress.Progress = True,
    steps_per_call: int | None = None,
    execution: str = "auto",
    mesh: Any = None,
    shard: str | None = None,
    opt_state: Any = None,
    accumulate: int = 1,
    shared_batches: bool | None = None,
    members_per_call: int | None = None,
    **shorthand: Any,
) -> FitResult:
    """Train ``model`` for ``steps`` more optimizer steps, fused into compiled
    loops (one ``lax.while_loop`` per call of ``steps_per_call`` steps).

    Conceptually equivalent to (NNX shown; the other kinds do the same with their
    own update)::

        start = optimizer.step  # 0 for a new optimizer
        for t in range(start, start + steps):
            batch = batch_at(data, t)  # array data: a function of t
            key_t = jax.random.fold_in(jax.random.split(key)[1], t)
            (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
                model, batch)  # or loss_fn(model, batch, key_t)
            if not all_finite(loss, grads):
                warn(...); break
            optimizer.update(model, grads)
            history.append(t + 1, loss, metrics)

    A call continues where the model's optimizer stopped: ``fit(steps=100)`` ten
    times gives exactly ``fit(steps=1000)`` once (the data order, the optimizer's
    schedule and moments, the per-step keys and the step numbers all continue).

    Compiling happens once per structure: a later call whose model, optimizer
    and ``loss_fn`` have the same structure and code (rebuilt objects, a new but
    equal ``optax.adam(1e-3)``, a re-defined ``loss_fn``), and any ``steps``,
    reuses the compiled loop; see ``docs/compile.md``.

    Arguments:
        model, optimizer: a ``scanax.population(...)`` and None (every member
            trained in one compiled loop, the population updated in place; see
            ``docs/populations.md``), or one of the supported pairs:
            ``(nnx.Module, nnx.Optimizer)``: both updated in place, starting from
            ``optimizer.step``;
            ``(Equinox module or any pytree of arrays, optax.GradientTransformation)``:
            the floating-point arrays are trained, starting from ``tx.init`` (or
            from ``opt_state``, at the step count it keeps);
            ``(flax TrainState, None)``: the state's own ``tx`` is used, starting
            from ``state.step``.
        loss_fn: ``loss_fn(model, batch)`` or ``loss_fn(model, batch, key)``
            (a fresh key per step: ``jax.random.fold_in(jax.random.split(key)[1],
            t)`` at global step ``t``; the key goes to a third parameter without
            a default, or to one named ``key``, ``rng`` or ``rngs`` with one),
            returning a scalar floating-point loss or ``(loss, metrics)`` with a
            dict of metrics: real arrays (bool, integer, floating) of a fixed
            shape each, recorded per step with that shape (complex values and
            text are refused by name). For a TrainState it receives the state
            holding the parameters being differentiated.
        data: a pytree of arrays with a leading example axis (with ``batch_size``):
            minibatches are drawn on device, reshuffled every epoch from ``key`` (in
            order when ``key`` is None), an incomplete last batch dropped; or an
            iterable (a list, generator, data loader...) of batches, consumed in
            order; training ends early, cleanly, when it runs out. Typed PRNG key
            arrays may be leaves of either.
        steps: the number of optimizer steps to add (at most, for an iterable).
        epochs: instead of ``steps``, for array data: ``epochs`` passes over
            the data, exactly ``epochs * (n // batch_size)`` steps (divided by
            ``accumulate``); ``history["epoch"]`` then gives each step's epoch
            (from 1, counted from the optimizer's step 0: a later call
            continues the count).
        batch_size: examples per step, for array data.
        key: a ``jax.random`` key: shuffles array data and, for a three-argument
            ``loss_fn``, gives the per-step keys.
        callbacks: the run's features, objects in any order (the engine orders
            their parts; each class at most once, log sinks any number):
            ``scanax.Eval(data, every=)``: evaluation inside the loop, and
            when the rules are checked; ``scanax.EarlyStop(monitor,
            patience=, best_dir=)``: stop on a monitored metric, keep the best
            model (restored; on disk with ``best_dir``); ``scanax.Plateau``:
            reduce the learning rate on a plateau; ``scanax.Ema(decay)``: a
            moving average of the parameters (``result.ema``);
            ``scanax.Precision("bfloat16" | "float16")``: compute in a lower
            precision (float16 with dynamic loss scaling, ``result.loss_scale``);
            ``scanax.Checkpoint(directory, every=)``: save and resume;
            ``scanax.TensorBoard``, ``scanax.CSV``, ``scanax.MLflow``,
            ``scanax.Log(fn)``: log sinks of windows of ``every`` steps. A
            stateful feature continues an earlier call's state with
            ``state=``. A population: each runs per member. See
            ``docs/training_features.md`` and ``docs/checkpoint.md``.
        progress: a tqdm bar with steps/s and the latest loss, updated between
            calls (and, for iterables or a given ``steps_per_call``, from inside
            the compiled loop). As in ``scanax.scan``: ``True``, ``False``
            (silent), an int (update every that many steps) or
            ``scanax.Progress(every=..., desc=..., ...)``.
        steps_per_call: steps run per compiled call; the progress bar, NaN check and
            checkpoints happen between calls. Results do not depend on it. Default:
            array data: sized automatically to about a quarter second per call
            (8 steps first, at most 1000; in a multi-process job, where every
            process must run the same calls, the compiled length: up to 1000);
            an iterable: 100 batches per call
            (fewer, rounded up to a power of two, when ``steps`` is smaller).
        execution: how each call runs its steps. ``"fused"``: one compiled
            loop per call, over chunks of steps of a static length (on a GPU,
            no host round trip per step; see ``docs/compile.md``);
            ``"stepwise"``: each chunk one dispatched compiled call (on CPU a
            chunk is one step: as a Python loop of ``jax.jit`` steps; the same
            program, the same results, every feature kept); ``"auto"``
            (default): fused, and once a call is timed and the steps left are
            worth it, the stepwise programs compiled on another thread and one
            call timed with them (not on a CPU of two cores or fewer, where
            that compile would slow the training it measures: fused there);
            the faster runs the rest, and the choice is kept for the program
            (and on disk with ``scanax.compile_cache``). ``result.execution``
            says which ran last.
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis to shard batches
            over; see ``docs/multi_device.md``. A population: a ``"members"``
            axis to split the members over (and optionally ``"data"``).
            Across the processes of a ``jax.distributed`` job: the same call in
            every process (see ``docs/multi_device.md``).
        shard: ``"fsdp"``: parameters and optimizer state split over the mesh's
            ``"data"`` axis too (each leaf on its largest axis the axis size
            divides; see ``docs/multi_device.md``). Default: replicated.
        opt_state: for an optax pair only: the optax state to start from (the
            ``result.optimizer`` of an earlier ``fit``), to continue training exactly
            where it stopped. Default: ``tx.init`` of the model's parameters.
        accumulate: micro-batches per optimizer step, their gradients averaged
            (as ``optax.MultiSteps``).
        shared_batches, members_per_call: populations only
            (``fit(scanax.population(...), None, ...)``, see
            ``docs/populations.md``): every member gets the batches of a solo
            ``fit(key=key)`` instead of its own order; train that many members
            at a time (default: all, or groups that fit in the devices' free
            memory, checked before the call runs).
        **shorthand: the keywords of the previous release, kept for this one
            as shorthand for the objects of ``callbacks``: ``eval_data``,
            ``eval_every``, ``eval_fn``, ``eval_batch_size`` (``Eval``),
            ``stop``, ``best_dir`` (``EarlyStop``), ``plateau``,
            ``plateau_state`` (``Plateau``), ``ema``, ``ema_eval``,
            ``ema_state`` (``Ema``), ``precision``, ``loss_scale_state``
            (``Precision``; ``"float32"``: none), ``checkpoint_dir``,
            ``checkpoint_every`` (``Checkpoint``), ``log``, ``log_every``
            (``Log`` of each sink). A keyword with its object in
            ``callbacks`` is refused.

    Returns:
        A :class:`FitResult` ``(model, optimizer, history, steps, best_step)``.

    Raises:
        TypeError: an unsupported (model, optimizer) pair, a non-scalar loss,
            ``steps`` or ``batch_size`` not an int, missing ``batch_size``,
            ``opt_state`` with a non-optax pair or unlike ``tx.init(params)``, a
            ``loss_fn`` taking a key without ``key``, a metric that is not a
            real array, ``eval_data`` unlike what the evaluation reads (named
            while tracing, before any step).
        ValueError: arrays in ``data`` with different leading sizes, a
            ``batch_size`` larger than the data, a non-positive ``steps``, a
            ``checkpoint_dir`` holding only steps past this call's end.
        OSError: a checkpoint or best state that could not be written (its
            class the cause's, e.g. ``PermissionError``), naming the newest
            complete checkpoint; ``fit`` returns or raises only once what it
            saved is on disk.

    A step whose loss or gradients are not finite is not applied: training stops
    there with a ``RuntimeWarning`` naming the step, and the result holds the last
    good state.
    If ``fit`` is interrupted (Ctrl-C) or fails, NNX objects hold the state after
    the last call checked to be finite, and the exception propagates.

    Example:
        >>> import jax.numpy as jnp, optax, scanax
        >>> x = jnp.arange(8.0)[:, None]
        >>> def loss_fn(params, batch):
        ...     xb, yb = batch
        ...     return jnp.mean((xb * params["w"] - yb) ** 2)
        >>> result = scanax.fit({"w": jnp.zeros(())}, optax.sgd(0.01), loss_fn,
        ...                     (x, 2 * x), steps=200, batch_size=4, progress=False)
        >>> round(float(result.model["w"]), 3), result.steps
        (2.0, 200)
    """
    callbacks = _shorthand.callbacks(callbacks, shorthand, PARAMETERS)
    config = _fit_config.configure(
        model,
        optimizer,
        loss_fn,
        data,
        callbacks,
        steps=steps,
        epochs=epochs,
        batch_size=batch_size,
        key=key,
        progress=progress,
        steps_per_call=steps_per_call,
        execution=execution,
        mesh=mesh,
        shard=shard,
        opt_state=opt_state,
        accumulate=accumulate,
        shared_batches=shared_batches,
        members_per_call=members_per_call,
    )
    setup = config.setup
    if config.population is None:
        result = _fit_solo.fit_model(config.adapter, opt_state, setup)
    else:
        result = _fit_population.fit_population(
            config.population,
            setup,
            config.shared,
            config.members_per_call,
            config.eval_takes,
        )
    if epochs is not None:
        result.history["epoch"] = setup.source.epoch_of(result.history["step"])
    rule = None if setup.checks is None else setup.checks.stop
    rule = getattr(rule, "stop", rule)  # (with a plateau rule: both, ``Rules``)
    if rule is not None:
        _early_stop.warn_never_finite(rule, result.history)
    return result


# fit's own parameters (what an unknown keyword is compared with)
PARAMETERS = [p for p in inspect.signature(fit).parameters if p != "shorthand"]
