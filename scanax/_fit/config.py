"""``scanax.fit``'s arguments checked, in the order a user meets them, into one
record (``Config``): the loop's own arguments and the features of
``callbacks=``, before anything runs or any file is touched."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .. import _caller, _eager, _nnx, _progress
from .._errors import (
    execution as execution_errors,
    fit as errors,
    plateau as plateau_errors,
    population as pop_errors,
    rollout as rollout_errors,
)
from . import (
    checks as _fit_checks,
    compile_cache as _compile_cache,
    engine as _fit_loop,
    evaluate as _evaluate,
    keys as _keys,
    logs as _fit_logs,
    mesh as _mesh,
    schedule as _fit_schedule,
)
from .callbacks import (
    checkpoint as _checkpointing,
    early_stop as _stop,
    ema as _ema,
    evaluation as _eval,
    plateau as _plateau,
    precision as _precision,
    sinks as _log,
)
from .data import arrays as _data, iterables as _iterables, rollout as _rollout
from .models import adapt as _models, population as _population

_CALL = errors.CALL
# The features a run's state and step are made of (``_feature``), by phase.
STATEFUL = (_plateau.Plateau, _ema.Ema, _precision.Precision)
# What ``callbacks=`` takes: each at most once, but log sinks.
KINDS = (
    _eval.Eval,
    _stop.EarlyStop,
    *STATEFUL,
    _checkpointing.Checkpoint,
)
SINKS = (_log.Log, _log.TensorBoard, _log.CSV, _log.MLflow)


class Config(NamedTuple):
    """What ``fit`` runs: one model's (``adapter``) or a population's
    (``population``, its options) run of ``setup``."""

    setup: _fit_loop.Setup
    adapter: Any  # ``_models`` adapter, or None
    population: Any  # ``_population.Population``, or None
    shared: bool  # a population's members share their batches
    members_per_call: int | None
    eval_takes: Any  # a population's eval_fn arguments, as loss_fn's


# loss functions warned of reading the trained model (held weakly: an epoch
# loop's calls warn once)
_WARNED_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warn_reads(loss_fn: Any, reads: str | None) -> None:
    """Warn that ``loss_fn`` reads the NNX model being trained as ``reads``
    from outside (a warning: reading a static attribute of it is no mistake),
    once per loss function."""
    if reads is None:
        return
    try:
        if reads in _WARNED_READS.get(loss_fn, ()):
            return
        _WARNED_READS.setdefault(loss_fn, set()).add(reads)
    except TypeError:  # (not weakly referenceable: warned every time)
        pass
    warnings.warn(
        errors.loss_fn_reads_the_model(reads),
        RuntimeWarning,
        stacklevel=_caller.user_level(),
    )


def configure(
    model, optimizer, loss_fn, data, callbacks, *, steps, epochs, batch_size, key,
    progress, steps_per_call, execution, mesh, shard, opt_state, accumulate,
    shared_batches, members_per_call,
) -> Config:  # fmt: skip
    """``fit``'s arguments checked (``callbacks``: the feature objects)."""
    if jax.config.jax_disable_jit:
        raise errors.under_disable_jit()
    if _eager.transformed():
        raise errors.under_transformation(_CALL)
    if epochs is None:
        if steps is None:
            raise errors.steps_missing()
        steps = _data.positive_int("steps", steps)
    elif steps is not None:
        raise errors.steps_and_epochs(steps, epochs)
    if not callable(loss_fn):
        raise errors.loss_fn_not_callable(loss_fn)
    found = sort(callbacks)
    pop = model if _population.is_population(model) else None
    _data.check_key(key, pop is not None)
    takes_hp, takes_key, key_param, hp_param = _keys.arguments(
        loss_fn, _CALL, "loss_fn", pop is not None
    )
    adapter, reads = None, None
    if pop is None:
        _no_population_options(shared_batches, members_per_call)
        # (the state of constants fit makes is kept for the next fit, but not
        # on a mesh: placed there, it may alias the kept arrays, which a fit
        # that runs no step would give back to the user)
        keep = _mesh.Placement(mesh).local
        adapter = _models.adapt(model, optimizer, opt_state, True, keep)
        if adapter.kind == "nnx":
            reads = _nnx.reads_itself(loss_fn, model)
            _warn_reads(loss_fn, reads)
            off = _nnx.dropout_off(model)
            if off:
                warnings.warn(
                    errors.dropout_in_eval_mode(off),
                    RuntimeWarning,
                    stacklevel=_caller.user_level(),
                )
    else:
        members_per_call = _population_options(
            pop, optimizer, opt_state, members_per_call
        )
    source = _data.make_source(data, batch_size, key)
    accumulate = _data.positive_int("accumulate", accumulate)
    if accumulate > 1:
        source.accumulate(accumulate)
    evaluation = found.get(_eval.Eval)
    stop, plateau = found.get(_stop.EarlyStop), found.get(_plateau.Plateau)
    every = None if evaluation is None else evaluation.every
    if epochs is not None:
        epochs = _data.positive_int("epochs", epochs)
        if isinstance(source, _rollout.RolloutSource):
            raise rollout_errors.epochs_with_rollout(epochs)
        if not isinstance(source, _data.ArraySource):
            raise errors.epochs_need_arrays(epochs, data)
        steps = source.steps_for(epochs)
        checked = evaluation is not None or stop is not None or plateau is not None
        if checked and every is None:
            if source.per_epoch % source.micro:  # (no step ends an epoch)
                raise errors.epoch_not_whole_steps(source.per_epoch, source.micro)
            every = source.per_epoch // source.micro  # (Keras: every epoch)
    shared = False
    if pop is not None:
        shared = _shared(pop, source, shared_batches, members_per_call)
    if takes_key and key is None:
        raise errors.loss_key_without_key(key_param)
    if steps_per_call is not None:
        steps_per_call = _data.positive_int("steps_per_call", steps_per_call)
    saving = found.get(_checkpointing.Checkpoint)
    checkpoint_dir = None if saving is None else saving.directory
    checkpoint_every = None if saving is None else saving.every
    if not isinstance(execution, str) or execution not in _fit_schedule.EXECUTIONS:
        raise execution_errors.unknown_execution(execution, _fit_schedule.EXECUTIONS)
    best_dir = None if stop is None else stop.best_dir
    if (
        best_dir is not None
        and checkpoint_dir is not None
        and _same(best_dir, checkpoint_dir)
    ):
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
    rules = stop if plateau is None else _fit_checks.Rules(stop, plateau)
    checks, eval_arrays, eval_call = _checks(
        evaluation, every, rules, batch_size, loss_fn, model, pop is not None
    )
    if key is None and eval_call is not None:  # (a placeholder key: unused?)
        _evaluate.fit_eval_key(
            model, eval_call, pop is not None, eval_arrays, checks.batch_size
        )
    loggers = _loggers(callbacks, pop is not None)
    eval_takes = None
    if pop is not None:
        if loggers and (members_per_call or pop.n) < pop.n:
            raise pop_errors.log_with_groups()
        if eval_call is not None:  # eval_fn's arguments: as loss_fn's (hp, key)
            name = "loss_fn" if evaluation.fn is None else "eval_fn"
            eval_takes = _keys.arguments(eval_call, _CALL, name, True)[:2]
    _compile_cache.enable_from_env()
    setup = _fit_loop.Setup(
        steps,
        # (an error while the loss is traced names it and the batch it got)
        _evaluate.guarded(
            loss_fn,
            _CALL,
            "loss_fn",
            hp=hp_param,
            reads=reads,
            # (fit records each step's epoch under that name)
            owned=() if epochs is None else ("epoch",),
        ),
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
        loggers,
        tuple(f for f in callbacks if isinstance(f, STATEFUL)),
        best_dir,
        execution,
    )
    return Config(setup, adapter, pop, shared, members_per_call, eval_takes)


def _same(a: Any, b: Any) -> bool:
    return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))


def sort(callbacks: list) -> dict:
    """``{kind: object}`` of ``callbacks=``'s features (each kind at most
    once; log sinks any number of times), refusing anything else by name."""
    found: dict = {}
    paths: dict = {}  # a file sink's path: two sinks writing one file lose rows
    for i, f in enumerate(callbacks):
        if isinstance(f, SINKS):
            path = getattr(f, "path", None) or getattr(f, "logdir", None)
            if path is not None:
                key = os.path.abspath(os.fspath(path))
                if key in paths:
                    raise errors.sinks_share_a_path(paths[key], type(f).__name__, path)
                paths[key] = type(f).__name__
            continue
        kind = next((k for k in KINDS if isinstance(f, k)), None)
        if kind is None:
            raise errors.callback_unknown(i, f, [k.__name__ for k in (*KINDS, *SINKS)])
        if kind in found:
            raise errors.callback_twice(kind.__name__)
        found[kind] = f
    return found


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
    iterable = isinstance(source, _iterables.IterSource)
    if shared_batches and isinstance(source, _rollout.RolloutSource):
        raise pop_errors.shared_batches_rollout()
    if shared_batches is False and iterable:
        raise pop_errors.shared_batches_iterable()
    if iterable and (members_per_call or pop.n) < pop.n:
        raise pop_errors.members_per_call_iterable()
    return iterable or bool(shared_batches)


def _loggers(callbacks: list, population: bool) -> tuple:
    """A logger per window length of the log sinks (none outside process 0 of
    a multi-process job: it logs once); an unwritable path is refused here,
    before anything runs."""
    out = []
    for every, sinks in _log.windows(callbacks).items():
        logger = _fit_logs.Logger(_fit_logs.Sinks(sinks), every, population)
        logger.sinks.check()
        out.append(logger)
    return tuple(out) if jax.process_index() == 0 else ()


def _checks(
    evaluation: Any,
    every: int | None,
    stop: Any,
    batch_size: Any,
    loss_fn: Callable,
    model: Any,
    population: bool = False,
) -> tuple[Any, Any, Any]:
    """``(checks, eval arrays, eval call)`` from ``Eval`` (``every``: its steps
    between evaluations, defaulted) and the rules checked at evaluations
    (``stop``: an ``EarlyStop``, or ``_fit_checks.Rules`` with a plateau
    rule), validated; ``(None, None, None)`` when none is given. For a
    population, the checks' ``evaluate`` is the function as given (its
    arguments are a population's: ``_fit_population`` wraps it)."""
    rules, plateau = stop, None
    if isinstance(stop, _fit_checks.Rules):
        stop, plateau = stop.stop, stop.plateau
    eval_data = None if evaluation is None else evaluation.data
    if evaluation is None and stop is None and plateau is None:
        return None, None, None
    if eval_data is None and stop is None and plateau is None:
        raise errors.eval_without_data()
    if every is None:
        if plateau is not None and stop is None and eval_data is None:
            raise plateau_errors.eval_every_missing()
        raise errors.eval_every_missing(eval_data is not None)
    if eval_data is None:
        if stop is not None and stop.monitor.startswith("val_"):
            raise errors.val_monitor_without_data(stop.monitor)
        if plateau is not None and plateau.monitor.startswith("val_"):
            raise plateau_errors.val_monitor_without_data(plateau.monitor)
        return _fit_checks.Checks(every, None, 0, 1, rules), None, None
    source = _data.ArraySource(eval_data, 1, None, "eval_data")  # (leading axes)
    # Default: batches of 1024 examples (of batch_size if larger), so that a
    # validation set of up to 1024 is one batch: one forward pass to compile,
    # where a loop over small batches doubled a small model's compile time.
    size = max(batch_size or 1, 1024)
    if evaluation.batch_size is not None:
        size = evaluation.batch_size
    name = "loss_fn" if evaluation.fn is None else "eval_fn"
    b = min(size, source.n)
    fn = loss_fn if evaluation.fn is None else evaluation.fn
    reads = None if population else _nnx.reads_itself(fn, model)
    fn = _evaluate.guarded(fn, _CALL, name, "eval_data", reads=reads)
    if population:
        call = fn
    else:
        takes_key = _keys.arguments(fn, _CALL, name).key
        call = fn if takes_key else (lambda model, batch, key: fn(model, batch))
    checks = _fit_checks.Checks(every, call, source.n, b, rules)
    return checks, eval_data, fn
