"""``stop=``: early stopping, as a static description (``EarlyStop``) plus pure
JAX functions on a small state that the compiled training loop carries.

The rule is Keras 3's ``keras.callbacks.EarlyStopping`` (``mode``, ``min_delta``,
``patience``), evaluated on device at each evaluation, so that the loop stops and
keeps its best state without a host round trip. The functions are elementwise in
the state: under ``jax.vmap`` each member of a population stops on its own.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _caller
from ..._errors import checkpoint as ckpt_errors, stop as errors
from .. import feature as _feature, scalars as _scalars
from ..checkpoint import local_directory
from ..models.step import SPARSE_PREFIXES

# ``mode="auto"`` (documented in ``EarlyStop.direction``): words of metrics that
# grow, and words that make a name a loss even then. Up to ``correlation``: every
# built-in Keras 3 metric whose ``_direction`` is "up", by the words of its default
# name (``binary_accuracy``, ``f1_score``, ``mean_io_u``...), and Keras's alias
# ``acc``; then common scores that only grow.
MAX_WORDS = (
    "acc", "accuracy", "auc", "precision", "recall", "sensitivity", "specificity",
    "f1", "fbeta", "r2", "iou", "io_u", "similarity", "correlation",
    "miou", "dice", "jaccard", "psnr", "ssim", "bleu", "rouge", "ndcg",
    "reward", "rewards", "return", "returns",
)  # fmt: skip
MIN_WORDS = ("loss", "error", "err")


def _words(words: tuple[str, ...]) -> re.Pattern:
    # a word not run together with other letters: digits and punctuation may
    # touch it (``top5_acc``, ``acc@1``, ``acc1``), letters may not (``accumulated``)
    return re.compile(r"(?<![a-z])(?:" + "|".join(words) + r")(?![a-z])")


_MAX, _MIN = _words(MAX_WORDS), _words(MIN_WORDS)


def auto_mode(monitor: str) -> str:
    """``"max"`` or ``"min"``: the direction ``mode="auto"`` gives the metric
    ``monitor``. ``"max"`` when its name (lowercased) holds one of
    ``MAX_WORDS`` as a word and none of ``MIN_WORDS``; ``"min"`` otherwise.

    Example:
        >>> from scanax._fit.callbacks.early_stop import auto_mode
        >>> [auto_mode(n) for n in ("val_accuracy", "top5_acc", "val_f1_score")]
        ['max', 'max', 'max']
        >>> [auto_mode(n) for n in ("val_loss", "mse", "dice_loss", "accumulated")]
        ['min', 'min', 'min', 'min']
        >>> [auto_mode(n) for n in ("rollout_return", "rollout_episode_reward")]
        ['max', 'max']
    """
    name = monitor.lower()
    return "max" if _MAX.search(name) and not _MIN.search(name) else "min"


class StopState(NamedTuple):
    """What ``EarlyStop`` carries from one evaluation to the next (a pytree).

    Attributes:
        best: the best monitored value so far (``+inf``/``-inf`` before any).
        best_step: the step of ``best``; ``-1`` before any improvement.
        wait: evaluations since the last improvement.
        stopped: whether the rule has said stop (then later updates change
            nothing).
    """

    best: jax.Array
    best_step: jax.Array
    wait: jax.Array
    stopped: jax.Array


MODES = ("auto", "min", "max")


@dataclasses.dataclass(frozen=True)
class EarlyStop(_feature.Feature):
    """Stop training when a monitored metric stops improving, and keep the best
    model (``scanax.fit(..., callbacks=[scanax.EarlyStop(...)])``).

    Conceptually equivalent to, at each evaluation (step ``step``, monitored
    value ``value``; ``first``: this is the first evaluation)::

        wait += 1
        if best is None or (value < best - min_delta if direction == "min"
                            else value > best + min_delta):
            best, best_step, wait = value, step, 0  # and keep the model
        elif wait >= patience and not first:
            stop                                     # and restore the kept model

    (``direction``: ``mode``, with ``"auto"`` resolved from the name), which is
    ``keras.callbacks.EarlyStopping(monitor, min_delta=min_delta,
    patience=patience, mode=mode)`` evaluated once per evaluation instead of once
    per epoch. Differences from Keras: ``mode="auto"`` decides from the name
    alone (Keras 3 asks the model's metric object of that name, and raises when
    there is none; scanax's metrics are names), see ``direction``;
    ``min_delta`` must be ``>= 0`` (Keras takes its absolute value); no
    ``baseline`` or ``start_from_epoch``; a NaN value is never an improvement,
    even the first (Keras takes a first NaN as the best, after which nothing
    improves on it). With ``restore_best``, the model kept is the best one, also
    when training ends without the rule stopping it (as Keras's
    ``restore_best_weights`` does).

    Arguments:
        monitor: the metric to watch: ``"loss"`` or another metric ``loss_fn``
            returns, or an evaluation metric ``"val_<name>"``.
        patience: evaluations without improvement after which training stops
            (``0``: at the first); None: never stop, only keep the best (to
            restore it, or save it with ``best_dir=``).
        min_delta: how much a value must beat the best by to count as an
            improvement (``>= 0``, in the direction of ``direction``).
        mode: ``"auto"`` (default: ``"max"`` for accuracies and other scores
            that grow, by the metric's name, ``"min"`` otherwise; see
            ``direction``), ``"min"`` (lower is better) or ``"max"``.
        restore_best: end with the best model (True, default) or the last one.
        best_dir: a directory where the best model is kept on disk (atomic,
            the newest best only), saved after each call that improved on it,
            on a thread of its own; ``scanax.load_best(best_dir, model,
            optimizer)`` loads it back (a population's: ``member=i``). Not
            part of the compiled program.

    Example:
        >>> import jax.numpy as jnp
        >>> import scanax
        >>> stop = scanax.EarlyStop("val_loss", patience=1)
        >>> state = stop.init()
        >>> for step, value in [(1, 3.0), (2, 2.0), (3, 2.5), (4, 2.1)]:
        ...     state, improved, done = stop.update(state, jnp.float32(value), step)
        ...     print(step, bool(improved), bool(done))
        1 True False
        2 True False
        3 False True
        4 False True
        >>> int(state.best_step), float(state.best)
        (2, 2.0)
        >>> scanax.EarlyStop("val_accuracy", patience=1).direction
        'max'
    """

    monitor: str
    _: dataclasses.KW_ONLY
    patience: int | None
    min_delta: float = 0.0
    mode: str = "auto"
    restore_best: bool = True
    best_dir: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            raise errors.monitor_type(self.monitor)
        if self.patience is None:
            pass  # never stops: the best is kept (and restored, saved) only
        elif isinstance(self.patience, bool) or not isinstance(
            self.patience, numbers.Integral
        ):
            raise errors.patience_type(self.patience)
        elif self.patience < 0:
            raise errors.patience_value(self.patience)
        if isinstance(self.min_delta, bool) or not isinstance(
            self.min_delta, numbers.Real
        ):
            raise errors.min_delta_type(self.min_delta)
        if not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise errors.min_delta_value(self.min_delta)
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise errors.bad_mode(self.mode)
        if not isinstance(self.restore_best, bool):
            raise errors.restore_best_type(self.restore_best)
        if self.best_dir is not None:
            try:
                path = os.fspath(self.best_dir)
            except TypeError:
                raise errors.best_dir_type(self.best_dir) from None
            path = local_directory(
                path,
                lambda p: ckpt_errors.remote_dir(p, "best_dir", "scanax.EarlyStop"),
            )
            if os.path.exists(path) and not os.path.isdir(path):
                raise errors.best_dir_not_dir(path)

    def program_key(self) -> tuple:
        """The rule, and whether a best state is saved (a population keeps
        one on device for ``best_dir``), not where."""
        return (self, self.best_dir is not None)

    @property
    def direction(self) -> str:
        """``"min"`` or ``"max"``: ``mode``, or with ``mode="auto"`` the direction
        of the metric's name. The name, lowercased, is ``"max"`` when it holds
        one of these words and none of ``loss``, ``error``, ``err``: ``acc``,
        ``accuracy``, ``auc``, ``precision``, ``recall``, ``sensitivity``,
        ``specificity``, ``f1``, ``fbeta``, ``r2``, ``iou`` (or Keras's
        ``io_u``), ``similarity``, ``correlation`` (the built-in Keras 3 metrics
        that grow, and the alias ``acc``), ``miou``, ``dice``, ``jaccard``,
        ``psnr``, ``ssim``, ``bleu``, ``rouge``, ``ndcg``, and a rollout's
        ``reward``, ``rewards``, ``return``, ``returns``; otherwise ``"min"``.
        A word counts where no letter touches it: ``val_top5_acc``, ``acc@1``
        and ``f1_score`` are maximised, ``accumulated`` and ``val_auc_loss``
        minimised. Every name Keras 3's ``mode="auto"`` resolves for its built-in
        metrics (their default names and aliases, ``val_`` or not) gets the same
        direction here."""
        return auto_mode(self.monitor) if self.mode == "auto" else self.mode

    def check_monitor(self, available: Iterable[str]) -> None:
        """Raise ``ValueError`` naming the available metrics if ``monitor`` is not
        among ``available`` (the names the run's history will have: ``loss``,
        ``loss_fn``'s metrics, ``val_*``). Call it before compiling."""
        names = list(available)
        if self.monitor not in names:
            raise errors.unknown_monitor(self.monitor, names)

    def init(self, dtype: Any = jnp.float32) -> StopState:
        """The state before the first evaluation (values compared in ``dtype``).
        For a population, ``jax.vmap`` it over a dummy axis or broadcast it."""
        return StopState(*(jnp.asarray(v, t) for v, t in _start(self, dtype)))

    def update(
        self, state: StopState, value: jax.Array, step: jax.Array
    ) -> tuple[StopState, jax.Array, jax.Array]:
        """One evaluation: ``(new state, improved, stop)``.

        ``value`` is the monitored metric (a scalar; per member under
        ``jax.vmap``), ``step`` the global step (``>= 0``) it was measured at.
        ``improved``: this value is the new best (keep the model: see
        ``keep_best``). ``stop``: end training now (stays true once it is).
        Pure and branch-free: usable inside ``lax.while_loop`` and ``jax.vmap``.
        """
        value = jnp.asarray(value)
        if value.ndim != 0:
            raise errors.monitor_not_scalar(self.monitor, value)
        with jax.named_scope("scanax.early_stop"):
            value = value.astype(state.best.dtype)
            better = beats(value, state.best, self.min_delta, self.direction)
            first = state.best_step < 0
            live = ~state.stopped
            improved = live & ~jnp.isnan(value) & (first | better)
            wait = jnp.where(improved, 0, state.wait + 1)
            # never at the first evaluation (Keras: `epoch > 0`)
            later = ~first | (state.wait > 0)
            if self.patience is None:  # keep the best, never stop
                stop = state.stopped
            else:
                stop = state.stopped | (
                    live & ~improved & later & (wait >= self.patience)
                )
            new = StopState(
                best=jnp.where(improved, value, state.best),
                best_step=jnp.where(
                    improved, jnp.asarray(step, jnp.int32), state.best_step
                ),
                wait=jnp.where(live, wait, state.wait),
                stopped=stop,
            )
            return new, improved, stop


def _start(rule: EarlyStop, dtype: Any) -> tuple:
    """The initial state's values and dtypes (``init``'s, ``kept_init``'s)."""
    worst = jnp.inf if rule.direction == "min" else -jnp.inf
    return (worst, dtype), (-1, jnp.int32), (0, jnp.int32), (False, None)


def kept_init(rule: EarlyStop, dtype: Any = jnp.float32) -> StopState:
    """``rule.init(dtype)`` as device scalars kept by value (``_scalars``): the
    carry a fit call starts from, with no transfer when a call repeats (a
    subclass's own ``init`` as it is). Shared arrays: for fit's carry alone."""
    if type(rule).init is not EarlyStop.init:
        return rule.init(dtype)
    return StopState(*(_scalars.constant(v, t) for v, t in _start(rule, dtype)))


def beats(value: jax.Array, best: jax.Array, min_delta: float, direction: str):
    """Whether ``value`` improves on ``best`` by more than ``min_delta`` in
    ``direction`` (``"min"`` or ``"max"``), in ``best``'s dtype; False for NaN
    (the rule of ``EarlyStop`` and ``Plateau``, as Keras's ``_is_improvement``)."""
    delta = jnp.asarray(min_delta, best.dtype)
    if direction == "min":
        return value + delta < best
    return value - delta > best


def keep_best(best: Any, current: Any, improved: jax.Array) -> Any:
    """``current`` where ``improved`` else ``best``, leaf by leaf (the kept state
    stays on device; under ``jax.vmap``, per member)."""
    return jtu.tree_map(lambda b, c: jnp.where(improved, c, b), best, current)


def warn_never_finite(rule: EarlyStop, history: dict) -> None:
    """After a call: warn when the monitored metric, an evaluation's or a
    rollout's (``val_*``, ``rollout_*``: history holds the values the rule
    compared), was never finite at the checks a model ran: the rule kept no
    best and counted every check against it. For a population (history
    ``[members, ...]``), per member, at the checks up to the last step it
    trained (the rest is padding). A monitored training metric is compared as
    its mean since the last check, which history does not hold: not warned."""
    prefix = next((p for p in SPARSE_PREFIXES if rule.monitor.startswith(p)), None)
    values = history.get(rule.monitor)
    if prefix is None or values is None or np.size(values) == 0:
        return
    values = np.asarray(values, np.float64)
    if values.ndim == 1:
        seen = {None: values}
    else:
        at = np.asarray(history[prefix + "step"])
        steps, loss = np.asarray(history["step"]), np.asarray(history["loss"])
        seen = {}
        for i, row in enumerate(values):
            trained = steps[np.isfinite(loss[i])]
            seen[i] = row[at <= trained.max()] if trained.size else row[:0]
    bad = [i for i, v in seen.items() if v.size and not np.isfinite(v).any()]
    if bad:
        members = None if values.ndim == 1 else bad
        count = max(seen[i].size for i in bad)
        message = errors.monitor_never_finite(rule.monitor, count, members)
        warnings.warn(message, RuntimeWarning, stacklevel=_caller.user_level())
