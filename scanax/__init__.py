"""scanax: a drop-in superset of ``jax.lax.scan``, layer stacks, multi-layer RNNs and
fused training loops for JAX, Flax NNX, Equinox and plain pytrees."""

from importlib.metadata import PackageNotFoundError, version as _version
from typing import TYPE_CHECKING

from . import _stack_adapters  # noqa: F401 (registers Stack's NNX and Equinox adapters)
from ._errors.log import SinkError as SinkError
from ._fit.api import fit as fit
from ._fit.callbacks.checkpoint import Checkpoint as Checkpoint, load_best as load_best
from ._fit.callbacks.early_stop import EarlyStop as EarlyStop
from ._fit.callbacks.ema import Ema as Ema
from ._fit.callbacks.evaluation import Eval as Eval
from ._fit.callbacks.loss_scale import LossScale as LossScale
from ._fit.callbacks.plateau import Plateau as Plateau, PlateauState as PlateauState
from ._fit.callbacks.precision import Precision as Precision
from ._fit.callbacks.sinks import (
    CSV as CSV,
    Log as Log,
    MLflow as MLflow,
    TensorBoard as TensorBoard,
)
from ._fit.compile_cache import compile_cache as compile_cache
from ._fit.data.rollout import Rollout as Rollout
from ._fit.evaluate import evaluate as evaluate, predict as predict
from ._fit.metrics import Ratio as Ratio
from ._fit.models.population import Population as Population, population as population
from ._fit.result import FitResult as FitResult
from ._linear_scan import linear_scan as linear_scan
from ._progress import Progress as Progress
from ._rnn import birnn as birnn, rnn as rnn
from ._scan import scan as scan
from ._stack import Stack as Stack, StackWarning as StackWarning
from ._until import scan_until as scan_until

if TYPE_CHECKING:
    from ._cells_linear import LRU as LRU, MinGRU as MinGRU


def __getattr__(name: str):  # LRU, MinGRU are NNX modules: flax only when asked
    if name in ("LRU", "MinGRU"):
        from . import _cells_linear

        return getattr(_cells_linear, name)
    from ._errors import no_attribute

    raise no_attribute(name)


try:
    __version__ = _version("scanax")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
