"""``scanax.fit``: many optimizer steps fused into one compiled loop per call."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from . import (
    _caller,
    _checkpoint,
    _compile_cache,
    _data,
    _ema,
    _evaluate,
    _fingerprint,
    _fit_checks,
    _fit_hooks,
    _fit_loop,
    _fit_population,
    _fit_program,
    _fit_schedule,
    _keys,
    _log,
    _loss_scale,
    _mesh,
    _models,
    _plateau,
    _population,
    _precision,
    _progress,
    _rollout,
    _stop,
)
from ._errors import (
    execution as execution_errors,
    fit as errors,
    plateau as plateau_errors,
    population as pop_errors,
    rollout as rollout_errors,
)

_CALL = errors.CALL


FitResult = _fit_loop.FitResult


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
    steps_per_call: int | None = None,
    progress: bool | int | _progress.Progress = True,
    opt_state: Any = None,
    checkpoint_dir: Any = None,
    checkpoint_every: int | None = None,
    mesh: Any = None,
    shard: str | None = None,
    shared_batches: bool | None = None,
    members_per_call: int | None = None,
    eval_data: Any = None,
    eval_every: int | None = None,
    eval_fn: Callable | None = None,
    eval_batch_size: int | None = None,
    stop: Any = None,
    plateau: Any = None,
    plateau_state: Any = None,
    log: Any = None,
    log_every: int = 10,
    accumulate: int = 1,
    ema: float | None = None,
    ema_eval: bool = False,
    ema_state: Any = None,
    precision: str | None = None,
    loss_scale_state: Any = None,
    best_dir: Any = None,
    execution: str = "auto",
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
        steps_per_call: steps run per compiled call; the progress bar, NaN check and
            checkpoints happen between calls. Results do not depend on it. Default:
            array data: sized automatically to about a quarter second per call
            (8 steps first, at most 1000; in a multi-process job, where every
            process must run the same calls, the compiled length: up to 1000);
            an iterable: 100 batches per call
            (fewer, rounded up to a power of two, when ``steps`` is smaller).
        progress: a tqdm bar with steps/s and the latest loss, updated between
            calls (and, for iterables or a given ``steps_per_call``, from inside
            the compiled loop). As in ``scanax.scan``: ``True``, ``False``
            (silent), an int (update every that many steps) or
            ``scanax.Progress(every=..., desc=..., ...)``.
        opt_state: for an optax pair only: the optax state to start from (the
            ``result.optimizer`` of an earlier ``fit``), to continue training exactly
            where it stopped. Default: ``tx.init`` of the model's parameters.
        checkpoint_dir, checkpoint_every: save, and resume from, checkpoints; see
            ``docs/checkpoint.md``.
        best_dir: keep the best model by ``stop=``'s monitor on disk (atomic,
            the newest best only), saved after each call that improved on it;
            ``scanax.load_best(best_dir, model, optimizer)`` loads it back into
            a pair of the same structure. Needs ``stop=scanax.EarlyStop(...)``
            (``patience=None``: never stop, only keep the best). A population:
            each member's best, ``load_best(..., member=i)``. Saves run on a
            thread of their own while training goes on; ``fit`` returns once
            the last is on disk (see ``docs/training_features.md``).
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis to shard batches
            over; see ``docs/multi_device.md``. A population: a ``"members"``
            axis to split the members over (and optionally ``"data"``).
            Across the processes of a ``jax.distributed`` job: the same call in
            every process (see ``docs/multi_device.md``).
        shard: ``"fsdp"``: parameters and optimizer state split over the mesh's
            ``"data"`` axis too (each leaf on its largest axis the axis size
            divides; see ``docs/multi_device.md``). Default: replicated.
        eval_data, eval_every, eval_fn, eval_batch_size: evaluate the whole
            ``eval_data`` (arrays) every ``eval_every`` steps inside the compiled
            loop, with ``eval_fn`` (default ``loss_fn``) in eval mode, in batches
            of ``eval_batch_size`` (default 1024, or ``batch_size`` if larger);
            its metrics join
            ``history`` as ``val_<name>`` at ``history["val_step"]``. With
            ``epochs=``, ``eval_every`` defaults to one epoch's steps (Keras
            validates every epoch). An ``eval_fn`` taking a key gets keys from
            ``key``; without ``key``, it is refused before training if its
            result in eval mode depends on the key.
        stop: a ``scanax.EarlyStop``: checked every ``eval_every`` steps; keeps
            the best state on device and restores it (``result.best_step``).
            A population: evaluation and ``stop`` run per member, each member
            stopping on its own; ``val_*`` histories are ``[members,
            evaluations]`` and ``result.best_step`` an int array (``-1``: the
            member kept no best state); see ``docs/populations.md``.
        plateau: a ``scanax.Plateau``: Keras's ``ReduceLROnPlateau``, checked
            every ``eval_every`` steps on its monitored metric: each step's
            update of the trained parameters is multiplied by a scale the rule
            lowers (``history["lr_scale"]``: each step's); its state is saved
            in checkpoints. A population: per member. See
            ``docs/training_features.md``.
        plateau_state: ``result.plateau`` of an earlier call with the same
            ``plateau=``: this call's rule continues from it (its scale, best
            value, wait and cooldown) instead of starting at scale 1, as an
            epoch loop of ``fit`` calls needs. A population's: per member.
        log, log_every: a sink (``scanax.TensorBoard``, ``scanax.CSV``, or any
            ``sink(step, metrics)``) or a list of them, given the metrics'
            means over each window of ``log_every`` steps and the evaluations,
            at the end of each compiled call. See ``docs/training_features.md``.
        accumulate: micro-batches per optimizer step, their gradients averaged
            (as ``optax.MultiSteps``).
        ema, ema_eval, ema_state: keep an exponential moving average of the
            trained parameters in the loop: ``e = p`` before the call's first
            step, then ``e = ema * e + (1 - ema) * p`` after each step applied
            (a non-finite step is not); ``result.ema`` is a model of the same
            kind holding it (a population's: ``result.ema[i]``, per member).
            ``ema_eval=True``: evaluations (and ``stop=`` on them) use the
            average. ``ema_state=result.ema`` continues an earlier call's
            average (checkpoints hold it too).
        precision: ``"bfloat16"``: compute the loss (and evaluations) in
            bfloat16, on a copy of the model whose floating parameters and on
            batches whose floating leaves are cast; the gradient, the update,
            the parameters and the optimizer state stay float32; loss and
            metrics are float32. ``"float16"``: the same in float16, with
            dynamic loss scaling (Keras's ``LossScaleOptimizer``): the gradient
            of ``scale * loss``, divided by ``scale``; a step whose gradients
            are not finite is skipped and halves the scale (down to 1), 2000
            good steps in a row double it; it starts at 2**15 in each call
            unless continued (``loss_scale_state``; ``history["loss_scale"]``:
            each step's; checkpoints save it). A non-finite loss, or non-finite
            gradients at scale 1, stop training as usual. Default None (or
            ``"float32"``, the same): nothing cast, the model computes in its
            own dtypes. See ``docs/training_features.md``.
        loss_scale_state: ``result.loss_scale`` of an earlier call with
            ``precision="float16"``: this call's loss scale continues from it
            (its scale and count of good steps) instead of 2**15, so that an
            epoch loop of calls skips no step twice to find it. A
            population's: per member.
        execution: how each call runs its steps. ``"fused"``: one compiled
            ``lax.while_loop`` per call; ``"stepwise"``: each step one
            dispatched compiled call, as a Python loop of ``jax.jit`` steps
            (the same step program: the same results, bit-identical on CPU,
            every feature kept); ``"auto"`` (default): fused, and once a call
            is timed and the steps left are worth it, the stepwise programs
            compiled on another thread and one call timed with them (not on a
            CPU of two cores or fewer, where that compile would slow the
            training it measures: fused there); the faster runs the rest, and the choice is kept for the program (and
            on disk with ``scanax.compile_cache``). ``result.execution`` says
            which ran last. See ``docs/compile.md``.
        shared_batches, members_per_call: populations only
            (``fit(scanax.population(...), None, ...)``, see
            ``docs/populations.md``): every member gets the batches of a solo
            ``fit(key=key)`` instead of its own order; train that many members
            at a time (default: all, or groups that fit in the devices' free
            memory, checked before the call runs).

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
    if epochs is None:
        if steps is None:
            raise errors.steps_missing()
        steps = _data.positive_int("steps", steps)
    elif steps is not None:
        raise errors.steps_and_epochs(steps, epochs)
    if not callable(loss_fn):
        raise errors.loss_fn_not_callable(loss_fn)
    pop = model if _population.is_population(model) else None
    _data.check_key(key, pop is not None)
    takes_hp, takes_key, key_param = _keys.arguments(
        loss_fn, _CALL, "loss_fn", pop is not None
    )
    if pop is None:
        _no_population_options(shared_batches, members_per_call)
        adapter = _models.adapt(model, optimizer, opt_state)
    else:
        members_per_call = _population_options(
            pop, optimizer, opt_state, members_per_call
        )
    source = _data.make_source(data, batch_size, key)
    accumulate = _data.positive_int("accumulate", accumulate)
    if accumulate > 1:
        source.accumulate(accumulate)
    if epochs is not None:
        epochs = _data.positive_int("epochs", epochs)
        if isinstance(source, _rollout.RolloutSource):
            raise rollout_errors.epochs_with_rollout(epochs)
        if not isinstance(source, _data.ArraySource):
            raise errors.epochs_need_arrays(epochs)
        steps = source.steps_for(epochs)
        checked = eval_data is not None or stop is not None or plateau is not None
        if checked and eval_every is None and source.per_epoch % source.micro == 0:
            eval_every = source.per_epoch // source.micro  # (Keras: every epoch)
    if pop is not None:
        shared = _shared(pop, source, shared_batches, members_per_call)
    if takes_key and key is None:
        raise errors.loss_key_without_key(key_param)
    low = _precision.check(precision)
    if loss_scale_state is not None:
        if not _precision.needs_scaling(low):
            raise errors.loss_scale_state_without_float16(precision)
        members = None if pop is None else pop.n
        loss_scale_state = _loss_scale.checked_state(loss_scale_state, members)
    ema = _ema.check_decay(ema)
    if ema is None and (ema_eval or ema_state is not None):
        raise errors.ema_option_without_ema("ema_eval" if ema_eval else "ema_state")

    if steps_per_call is not None:
        steps_per_call = _data.positive_int("steps_per_call", steps_per_call)
    checkpoint_every = _checkpoint_options(checkpoint_dir, checkpoint_every)
    if not isinstance(execution, str) or execution not in _fit_schedule.EXECUTIONS:
        raise execution_errors.unknown_execution(execution, _fit_schedule.EXECUTIONS)
    if best_dir is not None:
        if stop is None:
            raise errors.best_dir_without_stop()
        _checkpoint_options(best_dir, None)
        if checkpoint_dir is not None and os.path.abspath(
            os.fspath(best_dir)
        ) == os.path.abspath(os.fspath(checkpoint_dir)):
            raise errors.best_dir_is_checkpoint_dir(best_dir)
    _mesh.check_shard(shard, mesh, pop is not None)
    place = _mesh.Placement.of(mesh, None if pop is None else members_per_call or pop.n)
    place.check_source(source)
    place.check_processes(
        data,
        steps=steps,
        batch_size=batch_size,
        key=key,
        shard=shard,
        steps_per_call=steps_per_call,
        checkpoint_every=checkpoint_every,
    )
    spec = place.bar(_progress.resolve(_CALL, progress))
    rules = stop
    if plateau_state is not None and plateau is None:
        raise plateau_errors.state_without_plateau()
    scaled = None
    if plateau is not None:  # its carry joins the training state, after the model's
        if not isinstance(plateau, _plateau.Plateau):
            raise plateau_errors.plateau_type(plateau)
        if plateau_state is not None:
            members = None if pop is None else pop.n
            plateau_state = _plateau.checked_state(plateau_state, members)
        if pop is None:
            adapter = scaled = _plateau.ScaledAdapter(adapter, plateau, plateau_state)
        else:
            pop = scaled = _plateau.ScaledPopulation(pop, plateau, plateau_state)
        rules = _fit_checks.Rules(stop, plateau, scaled.at)
    checks_args = (eval_data, eval_every, eval_fn, eval_batch_size, rules)
    checks, eval_arrays, eval_call = _checks(
        *checks_args, batch_size, loss_fn, pop is not None
    )
    if key is None and eval_call is not None:  # (a placeholder key: unused?)
        _evaluate.fit_eval_key(
            model, eval_call, pop is not None, eval_arrays, checks.batch_size
        )
    logger = _logger(log, log_every, pop is not None)
    _compile_cache.enable_from_env()
    setup = _fit_loop.Setup(
        steps,
        loss_fn,
        takes_hp,
        takes_key,
        key,
        source,
        accumulate,
        steps_per_call,
        source.length(steps, steps_per_call),
        checkpoint_dir,
        checkpoint_every,
        place,
        shard,
        spec,
        checks,
        eval_arrays,
        eval_call,
        logger,
        low,
        None if ema is None else _ema.Options(ema, bool(ema_eval), ema_state),
        best_dir,
        execution,
        loss_scale_state,
    )
    if pop is None:
        result = _fit_model(adapter, opt_state, setup)
    else:
        if logger is not None and (members_per_call or pop.n) < pop.n:
            raise pop_errors.log_with_groups()
        takes = None  # eval_fn's arguments: as loss_fn's (hp, key)
        if eval_call is not None:
            name = "loss_fn" if eval_fn is None else "eval_fn"
            takes = _keys.arguments(eval_call, _CALL, name, True)[:2]
        result = _fit_population.fit_population(
            pop, setup, shared, members_per_call, takes
        )
    if epochs is not None:
        result.history["epoch"] = source.epoch_of(result.history["step"])
    if scaled is not None:
        result.plateau = scaled.final
    return result


def _no_population_options(shared_batches: Any, members_per_call: Any) -> None:
    options = (
        ("shared_batches", shared_batches),
        ("members_per_call", members_per_call),
    )
    for name, value in options:
        if value is not None:
            raise pop_errors.option_without_population(name)


def _population_options(
    pop: Any, optimizer: Any, opt_state: Any, members_per_call: Any
) -> int | None:
    """``members_per_call`` checked, after the arguments a population refuses."""
    if optimizer is not None:
        raise pop_errors.optimizer_with_population(optimizer)
    if opt_state is not None:
        raise pop_errors.opt_state_with_population()
    if members_per_call is None:
        return None
    members_per_call = _data.positive_int("members_per_call", members_per_call)
    if members_per_call > pop.n:
        raise pop_errors.members_per_call_too_large(members_per_call, pop.n)
    return members_per_call


def _shared(pop: Any, source: Any, shared_batches: Any, members_per_call: Any) -> bool:
    """Whether a population's members share their batches (iterables do)."""
    iterable = isinstance(source, _data.IterSource)
    if shared_batches and isinstance(source, _rollout.RolloutSource):
        raise pop_errors.shared_batches_rollout()
    if shared_batches is False and iterable:
        raise pop_errors.shared_batches_iterable()
    if iterable and (members_per_call or pop.n) < pop.n:
        raise pop_errors.members_per_call_iterable()
    return iterable or bool(shared_batches)


def _checkpoint_options(checkpoint_dir: Any, checkpoint_every: Any) -> int | None:
    if checkpoint_every is not None:
        if checkpoint_dir is None:
            raise errors.checkpoint_every_without_dir(checkpoint_every)
        checkpoint_every = _data.positive_int("checkpoint_every", checkpoint_every)
    if checkpoint_dir is not None:
        try:
            path = os.fspath(checkpoint_dir)
        except TypeError:
            raise errors.checkpoint_dir_type(checkpoint_dir) from None
        if os.path.exists(path) and not os.path.isdir(path):
            raise errors.checkpoint_dir_not_dir(path)
    return checkpoint_every


def _logger(log: Any, log_every: Any, population: bool) -> Any:
    """``log=``'s logger (None without sinks, and outside process 0 of a
    multi-process job: it logs once); an unwritable path is refused here,
    before anything runs."""
    if log is None:
        return None
    log_every = _data.positive_int("log_every", log_every)
    logger = _fit_checks.Logger(_log.Sinks(log), log_every, population)
    logger.sinks.check()
    return logger if jax.process_index() == 0 else None


def _fit_model(adapter: Any, opt_state: Any, setup: Any) -> FitResult:
    """One model's run: its state placed, its program built (or found), then
    trained from its optimizer's step."""
    start = adapter.start_step()
    if start is None:
        if opt_state is not None:
            warnings.warn(
                errors.no_step_count(), RuntimeWarning, stacklevel=_caller.user_level()
            )
        start = 0
    place, source, spec = setup.place, setup.source, setup.spec
    averaged = scaler = None
    if setup.ema is not None:  # the average joins the state
        adapter = averaged = _ema.EmaAdapter(adapter, *setup.ema)
    if _precision.needs_scaling(setup.precision):  # float16's loss scale too
        adapter = scaler = _loss_scale.LossScaledAdapter(
            adapter, setup.loss_scale_state
        )
    if isinstance(source, _rollout.RolloutSource):  # the feed too
        adapter = _rollout.FedAdapter(adapter, source, start)
    leaves, treedef = jtu.tree_flatten(adapter.state)
    leaves = _checkpoint.strong(leaves)
    leaves, shardings = place.state(adapter, leaves, setup.shard)
    # In-loop bar reports only where calls are not sized to a quarter second:
    # host batches, or a steps_per_call of the user's.
    ticks = spec is not None and place.local
    ticks = ticks and not source.sized_automatically(setup.steps_per_call)
    eval_arrays = place.replicate(setup.eval_arrays)
    program = _model_program(adapter, treedef, setup, shardings, ticks)
    bar_every = spec.every if spec is not None and not ticks else None
    schedule = _fit_schedule.Schedule(
        program,
        setup.length,
        source,
        setup.steps_per_call,
        setup.checkpoint_every,
        bar_every,
    )
    how = _fit_loop.How(start, start + setup.steps, spec, place, ticks, setup.execution)
    best = None
    if setup.best_dir is not None:  # the model's own leaves, first in the state
        n = jtu.tree_structure(getattr(adapter, "base", adapter).state).num_leaves
        writer = _fit_hooks.BestWriter(setup.best_dir, adapter.names()[:n], None)
        view = list  # ema_eval: the best judged on the average, saved as such
        if averaged is not None and averaged.on_eval:
            view = averaged.averaged_leaves
        best = _fit_hooks.BestSaver(writer, lambda leaves: view(leaves)[:n])
    extras = _fit_loop.Extras(setup.checks, eval_arrays, setup.logger, best)
    kind = _fit_loop.Model(adapter, treedef)
    run = _fit_loop.Run(kind, source, program, schedule, leaves, how, extras)
    if setup.checkpoint_dir is not None:
        run.resume(setup.checkpoint_dir, setup.checkpoint_every)
    fed = adapter if isinstance(adapter, _rollout.FedAdapter) else None
    try:
        result = run.go()
    except BaseException:
        if fed is not None and fed.pending is not None:
            fed.commit(handed_back=False, step=run.done)
        raise
    if fed is not None:
        fed.commit(handed_back=True, step=run.done)
    if averaged is not None:
        result.ema = averaged.ema
    if scaler is not None:
        result.loss_scale = scaler.final
    if setup.logger is not None:
        setup.logger.sinks.raise_pending(result)
    return result


def _model_program(
    adapter: Any, treedef: Any, setup: Any, shardings: Any, ticks: bool
) -> Any:
    """One model's chunk program, from the cache when an earlier ``fit`` had
    the same structure."""
    loss_fn, takes_key, checks = setup.loss_fn, setup.takes_key, setup.checks
    call = loss_fn if takes_key else (lambda model, batch, key: loss_fn(model, batch))
    if setup.precision is not None:
        call = _precision.wrap(call, adapter.kind, setup.precision)
    identity = _fit_program.identity(
        adapter.fingerprint(),
        adapter.static,
        loss_fn,
        None if checks is None else (checks.key(), _fingerprint_or(setup.eval_call)),
        takes_key,
        treedef,
        setup.source.static,
        setup.length,
        shardings,
        ticks,
        setup.precision,
    )
    sampler = setup.source.sampler()  # no data, no iterator: what the loop needs

    def build():
        lanes = _fit_program.Solo(
            _solo_step(adapter, treedef, call, setup.accumulate),
            sampler,
            setup.place,
            shardings,
            takes_key,
            _with_eval(checks, adapter, treedef, setup.precision),
            setup.accumulate,
        )
        return _fit_program.build_chunk(lanes, sampler, setup.length, ticks)

    return _fit_program.program(identity, build)


def _checks(
    eval_data: Any,
    eval_every: Any,
    eval_fn: Any,
    eval_batch_size: Any,
    stop: Any,
    batch_size: Any,
    loss_fn: Callable,
    population: bool = False,
) -> tuple[Any, Any, Any]:
    """``(checks, eval arrays, eval call)`` from ``fit``'s evaluation, early-stop
    and plateau arguments (``stop``: an ``EarlyStop``, or ``_fit_checks.Rules``
    with a plateau rule), validated; ``(None, None, None)`` when none is given.
    For a population, the checks' ``evaluate`` is ``eval_fn`` as given (its
    arguments are a population's: ``_fit_population`` wraps it)."""
    rules, plateau = stop, None
    if isinstance(stop, _fit_checks.Rules):
        stop, plateau = stop.stop, stop.plateau
    if eval_data is None and eval_every is None and stop is None and plateau is None:
        for name, value in (("eval_fn", eval_fn), ("eval_batch_size", eval_batch_size)):
            if value is not None:
                raise errors.eval_option_without_data(name)
        return None, None, None
    if stop is not None and not isinstance(stop, _stop.EarlyStop):
        raise errors.stop_type(stop)
    if eval_every is None:
        if plateau is not None and stop is None and eval_data is None:
            raise plateau_errors.eval_every_missing()
        raise errors.eval_every_missing(eval_data is not None)
    eval_every = _data.positive_int("eval_every", eval_every)
    if eval_data is None:
        if stop is None and plateau is None:
            raise errors.eval_every_without_data()
        if stop is not None and stop.monitor.startswith("val_"):
            raise errors.val_monitor_without_data(stop.monitor)
        if plateau is not None and plateau.monitor.startswith("val_"):
            raise plateau_errors.val_monitor_without_data(plateau.monitor)
        return _fit_checks.Checks(eval_every, None, 0, 1, rules), None, None
    if isinstance(eval_data, list) or not _data.is_array_data(eval_data):
        raise errors.eval_data_not_arrays(eval_data)
    source = _data.ArraySource(eval_data, 1, None, "eval_data")  # (leading axes)
    # Default: batches of 1024 examples (of batch_size if larger), so that a
    # validation set of up to 1024 is one batch: one forward pass to compile,
    # where a loop over small batches doubled a small model's compile time.
    size = max(batch_size or 1, 1024)
    if eval_batch_size is not None:
        size = _data.positive_int("eval_batch_size", eval_batch_size)
    if eval_fn is not None and not callable(eval_fn):
        raise errors.eval_fn_not_callable(eval_fn)
    name = "loss_fn" if eval_fn is None else "eval_fn"
    b = min(size, source.n)
    fn = _evaluate.guarded(
        loss_fn if eval_fn is None else eval_fn, _CALL, name, "eval_data"
    )
    if population:
        call = fn
    else:
        takes_key = _keys.arguments(fn, _CALL, name).key
        call = fn if takes_key else (lambda model, batch, key: fn(model, batch))
    checks = _fit_checks.Checks(eval_every, call, source.n, b, rules)
    return checks, eval_data, fn


def _fingerprint_or(fn: Any) -> Any:
    if fn is None:
        return None
    found = _fingerprint.of(fn)
    return fn if found is None else found


def _with_eval(checks: Any, adapter: Any, treedef: Any, precision: Any) -> Any:
    """``checks`` with its evaluation on flat leaves (in eval mode, in the
    ``precision`` computed in)."""
    if checks is None or checks.evaluate is None:
        return checks
    call = checks.evaluate
    if precision is not None:
        call = _precision.wrap(call, adapter.kind, precision)
    evaluate = adapter.make_eval(call)

    def flat(leaves, batch, key, hp):
        return evaluate(jtu.tree_unflatten(treedef, leaves), batch, key)

    return _fit_checks.Checks(
        checks.every, flat, checks.n, checks.batch_size, checks.stop
    )


def _solo_step(
    adapter: Any, treedef: Any, call: Callable, accumulate: int = 1
) -> Callable:
    """``step(leaves, batch, key, hp)`` on flat leaves (``hp`` is unused): the
    step gets containers of its own (an NNX step mutates the Variables it
    merges)."""
    step = adapter.make_step(call, accumulate)

    def flat_step(leaves, batch, key, hp):
        new, loss, metrics, grads = step(
            jtu.tree_unflatten(treedef, leaves), batch, key
        )
        return jtu.tree_leaves(new), loss, metrics, grads

    return flat_step
