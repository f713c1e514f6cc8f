"""Linear recurrent cells for ``scanax.rnn``: ``LRU`` and ``MinGRU`` (Flax NNX).

Both are ``h_t = a_t * h_{t-1} + b_t`` with ``a_t``, ``b_t`` computed from ``x_t``
alone, followed by a readout ``y_t = readout(h_t, x_t)``. ``LinearCell`` is that one
body: its ``__call__`` is one step (the definition, and what ``scanax.rnn`` runs
when the cell shares a loop with other layers); ``run_sequence`` computes ``a`` and
``b`` for every step at once and runs the recurrence with ``scanax.linear_scan``,
which ``scanax.rnn`` calls for a layer of such a cell (``_cells.SequenceCell``).
The two cells only say what ``a``, ``b`` and the readout are.

This module imports Flax NNX (its classes are ``nnx.Module``s); ``scanax`` imports it
only when ``scanax.LRU`` or ``scanax.MinGRU`` is asked for.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
from flax import nnx

from ._linear_scan import linear_scan


class LinearCell(nnx.Module, abc.ABC):
    """A cell ``h_t = a(x_t) * h_{t-1} + b(x_t)``, ``y_t = readout(h_t, x_t)``."""

    in_features: int
    hidden_features: int

    @abc.abstractmethod
    def coefficients(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(a, b)`` for inputs ``x`` (``[..., in_features]``), broadcastable to the
        state ``[..., hidden_features]``."""

    @abc.abstractmethod
    def readout(self, h: jax.Array, x: jax.Array) -> jax.Array:
        """The output at a step from its state and its input."""

    @abc.abstractmethod
    def state_dtype(self) -> Any:
        """The dtype of the state."""

    @property
    def num_feature_axes(self) -> int:
        """One feature axis (Flax's cell protocol: ``nnx.RNN`` and
        ``nnx.Bidirectional`` read it)."""
        return 1

    def initialize_carry(self, input_shape: tuple[int, ...], rngs: Any = None) -> Any:
        """Zeros of shape ``[*input_shape[:-1], hidden_features]`` (``rngs``
        unused: the signature of Flax's cells)."""
        return jnp.zeros((*input_shape[:-1], self.hidden_features), self.state_dtype())

    def __call__(self, carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One step: ``(h_t, y_t)`` from ``h_{t-1}`` and ``x_t``."""
        a, b = self.coefficients(x)
        h = a * carry + b
        return h, self.readout(h, x)

    def run_sequence(
        self,
        carry: jax.Array,
        xs: jax.Array,
        *,
        reverse: bool = False,
        seq_lengths: Any = None,
    ) -> tuple[jax.Array, jax.Array]:
        """All steps of time-major ``xs`` (``[T, *batch, in_features]``) at once:
        ``(final h, ys)``, the same as ``__call__`` at every step (see
        ``scanax.linear_scan`` for ``reverse`` and ``seq_lengths``)."""
        a, b = self.coefficients(xs)
        with jax.named_scope(f"scanax.{type(self).__name__}"):
            hs, h = linear_scan(a, b, carry, reverse=reverse, seq_lengths=seq_lengths)
        return h, self.readout(hs, xs)


class MinGRU(LinearCell):
    """minGRU (Feng et al. 2024, "Were RNNs All We Needed?"): a GRU whose gate and
    candidate read only the input, so that it is a linear recurrence in ``h``.

    Conceptually equivalent to, at each step::

        z = sigmoid(x @ W_z + b_z)
        h_tilde = x @ W_h + b_h
        h = (1 - z) * h + z * h_tilde      # the output is h

    Arguments:
        in_features: the input width.
        hidden_features: the state (and output) width.
        rngs: ``nnx.Rngs`` for the two ``nnx.Linear`` layers (``gate``,
            ``candidate``).
        param_dtype: their parameters' dtype.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> from flax import nnx
        >>> cell = scanax.MinGRU(2, 4, rngs=nnx.Rngs(0))
        >>> (h,), ys = scanax.rnn([cell], jnp.ones((5, 3, 2)))  # [T, B, D]
        >>> h.shape, ys.shape
        ((3, 4), (5, 3, 4))
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        self.in_features = in_features
        self.hidden_features = hidden_features
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.gate = nnx.Linear(in_features, hidden_features, **kw)
        self.candidate = nnx.Linear(in_features, hidden_features, **kw)

    def coefficients(self, x):
        k = self.gate(x)
        # 1 - sigmoid(k) as sigmoid(-k): exact for large k, where 1 - z rounds to 0
        return jax.nn.sigmoid(-k), jax.nn.sigmoid(k) * self.candidate(x)

    def readout(self, h, x):
        return h

    def state_dtype(self):
        return self.candidate.kernel[...].dtype


def _complex(re: jax.Array, im: jax.Array) -> jax.Array:
    """``re + 1j im``; complex64 for 16-bit floats, which have no complex type
    (``jax.lax.complex`` takes float32 and float64 only)."""
    if jnp.finfo(re.dtype).bits < 32:
        re, im = re.astype(jnp.float32), im.astype(jnp.float32)
    return jax.lax.complex(re, im)


class LRU(LinearCell):
    """The Linear Recurrent Unit (Orvieto et al. 2023, "Resurrecting Recurrent
    Neural Networks for Long Sequences"): a complex diagonal recurrence with a
    stable exponential parametrisation and a normalised input.

    Conceptually equivalent to, at each step::

        lam = exp(-exp(nu_log) + 1j * exp(theta_log))       # |lam| < 1
        h = lam * h + exp(gamma_log) * (B @ x)              # B = B_re + 1j B_im
        y = real(C @ h) + D * x                             # C = C_re + 1j C_im

    The state ``h`` is complex (``[..., hidden_features]``, complex64 for float32
    and 16-bit parameters, which have no complex type); the output has the
    input's width (``D`` is a skip connection), in the parameters' dtype.

    Initialisation, as the paper's: ``|lam|`` uniform on the ring ``[r_min,
    r_max]``, the phase uniform on ``[0, max_phase]``; ``gamma_log = log(sqrt(1 -
    |lam|^2))``; ``B_re``, ``B_im`` normal with variance ``1 / (2 in_features)``,
    ``C_re``, ``C_im`` with variance ``1 / hidden_features``, ``D`` standard normal.

    Arguments:
        in_features: the input (and output) width ``H``.
        hidden_features: the state width ``N``.
        rngs: ``nnx.Rngs``; its ``params`` stream initialises the parameters.
        r_min, r_max: the ring of ``|lam|`` at initialisation (the paper's
            defaults 0 and 1; it uses ``r_min=0.9, r_max=0.999`` for long-range
            tasks).
        max_phase: the largest phase of ``lam`` at initialisation (``2 pi``).
        param_dtype: the parameters' dtype.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> from flax import nnx
        >>> cell = scanax.LRU(2, 8, rngs=nnx.Rngs(0), r_min=0.9, r_max=0.999)
        >>> (h,), ys = scanax.rnn([cell], jnp.ones((5, 3, 2)))
        >>> h.dtype, h.shape, ys.shape
        (dtype('complex64'), (3, 8), (5, 3, 2))
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        *,
        rngs: nnx.Rngs,
        r_min: float = 0.0,
        r_max: float = 1.0,
        max_phase: float = 2 * math.pi,
        param_dtype: Any = jnp.float32,
    ):
        self.in_features = in_features
        self.hidden_features = hidden_features
        h, n = in_features, hidden_features
        keys = jr.split(rngs.params(), 7)
        u1 = jr.uniform(keys[0], (n,), param_dtype)
        u2 = jr.uniform(keys[1], (n,), param_dtype)
        nu_log = jnp.log(-0.5 * jnp.log(u1 * (r_max**2 - r_min**2) + r_min**2))
        # 1 - |lam|^2 = 1 - exp(-2 exp(nu_log)), without the cancellation near 1
        gamma_log = 0.5 * jnp.log(-jnp.expm1(-2 * jnp.exp(nu_log)))
        self.nu_log = nnx.Param(nu_log)
        self.theta_log = nnx.Param(jnp.log(max_phase * u2))
        self.gamma_log = nnx.Param(gamma_log)

        def normal(key, shape, var):
            return nnx.Param(jr.normal(key, shape, param_dtype) * math.sqrt(var))

        self.B_re = normal(keys[2], (n, h), 1 / (2 * h))
        self.B_im = normal(keys[3], (n, h), 1 / (2 * h))
        self.C_re = normal(keys[4], (h, n), 1 / n)
        self.C_im = normal(keys[5], (h, n), 1 / n)
        self.D = normal(keys[6], (h,), 1.0)

    def lam(self) -> jax.Array:
        """The diagonal of the recurrence, ``exp(-exp(nu_log) + 1j exp(theta_log))``."""
        return jnp.exp(
            _complex(-jnp.exp(self.nu_log[...]), jnp.exp(self.theta_log[...]))
        )

    def coefficients(self, x):
        gamma = jnp.exp(self.gamma_log[...])[:, None]
        b_re = x @ (self.B_re[...] * gamma).T
        b_im = x @ (self.B_im[...] * gamma).T
        return self.lam(), _complex(b_re, b_im)

    def readout(self, h, x):
        re, im = jnp.real(h), jnp.imag(h)  # (float32 for 16-bit parameters)
        c_re, c_im = (c[...].T.astype(re.dtype) for c in (self.C_re, self.C_im))
        y = (re @ c_re - im @ c_im).astype(self.C_re[...].dtype)  # (16-bit: back)
        return y + self.D[...] * x

    def state_dtype(self):
        return (
            jnp.complex128 if self.nu_log[...].dtype == jnp.float64 else jnp.complex64
        )
