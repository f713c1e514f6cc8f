"""How ``scanax.scan``'s long-scan options (progress, remat, keep) compose.

Each option is a transformation of the :class:`~scanax._loop.Loop` or a lowering of
it: ``remat=True``/policy checkpoints the body; ``progress`` runs the steps in
chunks of ``every`` and ticks an internal counter before each chunk, outside any
checkpointed region (with thinning, once per step instead); ``keep_every``/
``keep`` and ``remat="sqrt"`` are nested-scan lowerings (together, the sqrt
nesting runs the scan over kept-output chunks). With every option off,
``scanax.scan`` never comes here and runs the plain ``lax.scan``.
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

    def run(self, call: str, loop: Loop, reverse: bool, unroll: Any) -> Any:
        thin = self.keep_every != 1 or self.keep != "all"
        if thin:
            _thin.check_length(call, loop.length, self.keep_every, self.keep)
        reporter = None
        if self.progress is not None and loop.length > 0:
            reporter = _progress.Reporter(self.progress, loop.length)
        if self.remat == "sqrt" and loop.length > 0:
            # Progress ticks per chunk, outside the checkpointed chunks.
            k, keep = self.keep_every, self.keep
            if thin:
                return _thin.run_thinned(
                    loop, reverse, unroll, k, keep, sqrt=True, reporter=reporter
                )
            count = None
            if reporter is not None:
                reporter.plan(_remat.blocks(loop.length, reverse))
                count = reporter.init()
            carry, ys, _ = _remat.run_sqrt(loop, reverse, unroll, reporter, count)
        elif reporter is not None and not thin:
            # Chunks of `every` steps, one tick before each: nothing per step.
            if self.remat is not None:
                loop = _remat.checkpoint_body(loop, self.remat)
            blocks = _remat.blocks(loop.length, reverse, chunk=reporter.every)
            reporter.plan(blocks)
            with jax.named_scope("scanax.progress"):
                carry, ys, _ = _remat.run_chunks(
                    loop, reporter.every, reverse, unroll, reporter, reporter.init()
                )
        else:
            if self.remat is not None and self.remat != "sqrt":
                loop = _remat.checkpoint_body(loop, self.remat)
            if reporter is not None:
                loop = reporter.wrap(loop)
            if thin:
                carry, ys = _thin.run_thinned(
                    loop, reverse, unroll, self.keep_every, self.keep
                )
            else:
                carry, ys = run_lax(loop, reverse, unroll)
            if reporter is not None:
                carry, _ = carry
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
