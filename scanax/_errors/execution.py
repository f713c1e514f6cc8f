"""Messages of ``scanax.fit(execution=...)``'s errors."""

from __future__ import annotations

from typing import Any

CALL = "scanax.fit"


def unknown_execution(value: Any, known: tuple) -> TypeError | ValueError:
    kind = ValueError if isinstance(value, str) else TypeError
    return kind(
        f"{CALL}: `execution` must be one of {', '.join(map(repr, known))}, got "
        f'{value!r}.\nFix: execution="auto" (the default: fused, switching to '
        'stepwise where that measures faster), "fused" (one compiled loop per '
        'call) or "stepwise" (one dispatched compiled call per step).'
    )
