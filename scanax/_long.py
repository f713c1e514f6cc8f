"""How ``scanax.scan``'s long-scan options (progress, remat, keep) compose.

``Options.run`` first transforms the :class:`~scanax._loop.Loop`, then lowers it
once. The transformations (``Loop -> Loop``): ``remat=True``/a policy checkpoints
the body; a progress bar over thinned outputs without ``remat="sqrt"`` ticks an
internal counter inside the body, once per step. The lowering, one of:

* thinned outputs (``keep_every``/``keep``), its outer scan √T-nested with
  ``remat="sqrt"``, a progress bar ticking before each kept chunk;
* chunks: of √T checkpointed steps (``remat="sqrt"``) or of a progress bar's
  ``every`` steps, the bar ticking before each chunk, outside any checkpoint (so
  a bar costs nothing per step);
* one ``lax.scan``.

With every option off, ``scanax.scan`` never comes here and runs the plain
``lax.scan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _progress, _remat, _thin
from ._errors import long as errors
from ._loop import Loop, run_lax


@dataclasses.dataclass(frozen=True)
class Options:
    progress: _progress.Progress | None
    remat: Any
    keep_every: int
    keep: Any

    @property
    def thin(self) -> bool:
        return self.keep_every != 1 or self.keep != "all"

    def run(self, call: str, loop: Loop, reverse: bool, unroll: Any) -> Any:
        if self.thin:
            _thin.check_length(call, loop.length, self.keep_every, self.keep)
        reporter = None
        if self.progress is not None and loop.length > 0:
            reporter = _progress.Reporter(self.progress, loop.length)
        sqrt = self.remat == "sqrt" and loop.length > 0
        if self.remat is not None and self.remat != "sqrt":
            loop = _remat.checkpoint_body(loop, self.remat, unroll)
        per_step = reporter is not None and self.thin and not sqrt
        if per_step:  # the thinned lowering ticks between chunks only with sqrt
            loop, reporter = reporter.wrap(loop), None
        carry, ys = self.lower(loop, reverse, unroll, sqrt, reporter)
        return (carry[0] if per_step else carry), ys

    def lower(
        self, loop: Loop, reverse: bool, unroll: Any, sqrt: bool, reporter: Any
    ) -> tuple[Any, Any]:
        """The one lowering (see the module's docstring); ``reporter`` ticks
        between chunks."""
        if self.thin:
            k, keep = self.keep_every, self.keep
            return _thin.run_thinned(
                loop, reverse, unroll, k, keep, sqrt=sqrt, reporter=reporter
            )
        if sqrt or reporter is not None:
            return _chunks(loop, reverse, unroll, sqrt, reporter)
        return run_lax(loop, reverse, unroll)


def _chunks(
    loop: Loop, reverse: bool, unroll: Any, sqrt: bool, reporter: Any
) -> tuple[Any, Any]:
    """Chunks of √T checkpointed steps (``sqrt``), else of the bar's ``every``."""
    c = _remat.chunk_size(loop.length) if sqrt else reporter.every
    count = None
    if reporter is not None:
        reporter.plan(_remat.blocks(loop.length, reverse, chunk=c))
        count = reporter.init()
    with jax.named_scope("scanax.remat_sqrt" if sqrt else "scanax.progress"):
        carry, ys, _ = _remat.run_chunks(
            loop, c, reverse, unroll, reporter, count, checkpoint=sqrt
        )
    return carry, ys


def resolve(
    call: str,
    *,
    progress: Any,
    remat: Any,
    keep_every: Any,
    keep: Any,
    out_axes: Any = 0,
) -> Options | None:
    """Validated options, or None when all are off (the plain ``lax.scan``)."""
    spec = _progress.resolve(call, progress)
    remat = _remat.resolve(call, remat)
    keep_every, keep = _thin.resolve(call, keep_every, keep)
    thin = keep_every != 1 or keep != "all"
    no_axis = isinstance(out_axes, int) and not isinstance(out_axes, bool)
    if keep != "all" and not (no_axis and out_axes == 0):
        name = keep if isinstance(keep, str) else "a function"
        raise errors.out_axes_reduced(call, name, out_axes)
    if spec is None and remat is None and not thin:
        return None
    return Options(spec, remat, keep_every, keep)
