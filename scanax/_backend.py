"""Which kind of device scanax's per-backend rules decide for.

Rules that differ by backend (``fit``'s chunk length, ``linear_scan``'s
``method="auto"``, the CPU convolution layout) read it here, through one
function, so that a test on a CPU machine can ask for the decision a GPU would
get (``monkeypatch.setattr(scanax._backend, "platform", lambda: "gpu")``) and
check the program it builds.
"""

from __future__ import annotations

import jax


def platform() -> str:
    """The default backend's platform: ``"cpu"``, ``"gpu"``, ``"tpu"``..."""
    return jax.default_backend()
