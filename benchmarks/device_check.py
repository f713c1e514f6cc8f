"""Every accelerator row the README claims, on whatever device JAX finds, in under
5 minutes on an H200: ``python benchmarks/device_check.py`` (``--quick``: every
size shrunk, a smoke test of the script on a CPU in a few minutes; part names
after it, e.g. ``linear_rows conv_rows``: those parts alone).

It prints one line per row and writes nothing. A ratio row reads ``name: ratio
[lo-hi] (a vs b)``: the median over interleaved rounds of the per-round ratio,
its range, and the two medians; the rounds are as many as fit in about a second
of the slower candidate (at least 7). Parts, most important first (a part that
would start past ``BUDGET`` seconds is skipped with a line):

* GPT-2 small (124M: 12 layers, d 768, 12 heads, T 1024, batch 16, vocab 50257,
  bfloat16 compute, float32 parameters, AdamW; Flax NNX), a Python loop of one
  donated ``jax.jit`` step: the unrolled blocks against ``scanax.Stack`` with its
  default remat, Flax's own ``nnx.scan`` over the same blocks, and three
  alternatives (``remat=False``, ``checkpoint_dots``, ``unroll=2``): step time
  ÷ unrolled, compile seconds, memory (XLA's buffer assignment: arguments,
  temporaries and outputs not aliased), tokens/s and MFU against the chip's
  dense bfloat16 peak (``PEAK_FLOPS``), in two groups; then ``scanax.fit``'s
  time per step ÷ the hand-written loop's on the Stack model;
* ``fit`` against a hand-fused ``jax.jit(lax.scan)`` of the same Adam step (tiny
  32-32-1 MLP batch 8, small 784-256-10 batch 64): no options, and evaluation +
  progress bar + ``EarlyStop``; ``execution="stepwise"`` ÷ fused; what
  ``execution="auto"`` chose; fit's first call ÷ the hand-fused script's first
  call, each in a fresh process (compile included);
* the loop kinds of a tiny-MLP Adam step, 2000 steps, in µs/step and ÷
  ``lax.scan``: ``lax.scan``, a ``while_loop`` with a dynamic bound, a
  ``while_loop`` over ``lax.scan`` chunks of 10, a dynamic ``while_loop`` with
  fit's own non-finite test and a select (the H200's row used an elementwise
  ``isfinite``), ``scanax.fit``;
* side by side, a 784-512-512-10 MLP, Adam, batch 128, 2000 steps: fit's second
  call, a hand-fused scan, a Python loop of ``nnx.jit`` steps, a PyTorch eager
  loop and Lightning's ``Trainer.fit`` on the same data (those two only where
  torch/lightning are installed; a line says when they are not);
* ``linear_scan``: each method ÷ ``lax.scan`` (batch 1024, 16 features, T 1k and
  4k, forward and gradient) and ``auto`` ÷ the best; ``method="associative"`` ÷
  the hand-written ``lax.associative_scan`` (minimal-LRU shapes);
* ``scanax.scan`` ÷ ``lax.scan`` (a matmul body, 10k steps); ``scanax.rnn``'s
  ``order="time"`` ÷ ``"layer"``; a small-CNN Adam step in ``scanax.scan`` ÷
  ``lax.scan`` (200 and 2000 steps);
* where fit's time goes (last: no target of their own): fit's program and the
  hand-fused one in device time (a profiler trace); fit per step and per
  call (each timed at 1024 and 4096 steps: slope and intercept ÷ the
  hand-fused scan's, with the hand-fused scan as chunks with and without an
  evaluating ``lax.cond``); fit's call in phases; the hand-fused scan with
  one of fit's per-step pieces added (the shuffled rows' gather of ``key=``,
  the non-finite test with a select and without one, the gradients' marks
  fit's chunks run instead), fit as planned here and planned as on CPU, bare
  and with evaluation and ``EarlyStop``.

Time on an H200 (estimated, not measured): GPT-2 about 2-3 minutes (six compiles
of 5-30 s, 30 timed steps of each variant at 60-90 ms), the rest about 3 minutes
(the earlier rows took 51 s; the fresh processes about 30 s). On a TPU v5e:
GPT-2 141 s, fit_rows 30 s, fit_slope_rows 25 s, first_call_rows 264 s (12
fresh processes, each paying the TPU runtime's ~12 s start). Parts past ``BUDGET`` are
skipped with a line; name them to run them (``python benchmarks/device_check.py
fit_slope_rows fit_piece_rows``).
"""

# ruff: noqa: B023  (each loop's closures are timed within their own iteration)
from __future__ import annotations

import os

# torch and several JAX programs share the device: JAX takes memory as it needs it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import scanax  # noqa: E402

QUICK = "--quick" in sys.argv
BUDGET = 290.0  # seconds: no part starts after this
MIN_ROUNDS, ROUND_SECONDS = 7, 1.0
# Dense bfloat16 peak FLOP/s by device kind (a substring of ``device_kind``).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v4": 275e12,
}


# ---------------------------------------------------------------------------- timing


def _block(x):
    """``x`` on the host: what a user's next line reads (fit's history is there
    when it returns; a hand-written scan's losses are fetched too)."""
    return jax.device_get(jax.block_until_ready(x))


def _once(fn) -> float:
    t0 = time.perf_counter()
    _block(fn())
    return time.perf_counter() - t0


def _rounds(fns: dict, rounds: int | None = None) -> dict[str, list[float]]:
    """Each zero-argument callable run once (compile), then round robin."""
    first = {k: _once(f) for k, f in fns.items()}
    slowest = max(_once(f) for f in fns.values()) if rounds is None else 0.0
    del first
    if rounds is None:
        rounds = min(50, max(MIN_ROUNDS, math.ceil(ROUND_SECONDS / max(slowest, 1e-6))))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(_once(f))
    return times


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(r), min(r), max(r)


def _line(name: str, a: list[float], b: list[float], note: str = "") -> float:
    med, lo, hi = _ratio(a, b)
    ta, tb = statistics.median(a), statistics.median(b)
    print(
        f"{name}: {med:.3f} [{lo:.2f}-{hi:.2f}] ({ta:.4g} s vs {tb:.4g} s, "
        f"{len(a)} rounds){note}",
        flush=True,
    )
    return med


def _pair(name: str, a, b, note: str = "", rounds: int | None = None) -> float:
    t = _rounds({"a": a, "b": b}, rounds)
    return _line(name, t["a"], t["b"], note)


def _peak() -> float | None:
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None


# ---------------------------------------------------------------------------- GPT-2


def _gpt2_batch() -> int:
    """16 sequences where the unrolled model's step fits (an H200's 141 GB); else
    the largest power of two that does: the unrolled step took 30 GB of
    temporaries at 16 on a TPU v5e (16 GB), about 1.9 GB a sequence."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    batch = 16
    while batch > 1 and batch * 1.9e9 > 0.7 * limit:
        batch //= 2
    return batch


def _gpt2_parts():
    from flax import nnx

    if QUICK:
        cfg = dict(layers=2, d=64, heads=2, t=32, batch=2, vocab=256)
    else:
        cfg = dict(layers=12, d=768, heads=12, t=1024, batch=_gpt2_batch(), vocab=50257)
    d, nh, t, vocab = cfg["d"], cfg["heads"], cfg["t"], cfg["vocab"]
    bf16 = jnp.bfloat16

    class Block(nnx.Module):
        def __init__(self, rngs):
            lin = lambda i, o: nnx.Linear(i, o, dtype=bf16, rngs=rngs)
            self.ln1 = nnx.LayerNorm(d, dtype=bf16, rngs=rngs)
            self.qkv, self.proj = lin(d, 3 * d), lin(d, d)
            self.ln2 = nnx.LayerNorm(d, dtype=bf16, rngs=rngs)
            self.up, self.down = lin(d, 4 * d), lin(4 * d, d)

        def __call__(self, x):
            b, n, _ = x.shape
            q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, -1)
            heads = lambda z: z.reshape(b, n, nh, d // nh)
            s = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / (d // nh) ** 0.5
            causal = jnp.tril(jnp.ones((n, n), bool))
            p = jax.nn.softmax(jnp.where(causal, s.astype(jnp.float32), -1e9), -1)
            a = jnp.einsum("bhqk,bkhd->bqhd", p.astype(bf16), heads(v))
            x = x + self.proj(a.reshape(b, n, d))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs, stack):
            self.wte = nnx.Embed(vocab, d, dtype=bf16, rngs=rngs)
            self.wpe = nnx.Embed(t, d, dtype=bf16, rngs=rngs)
            blocks = [Block(rngs) for _ in range(cfg["layers"])]
            self.stacked = stack is not None
            self.blocks = stack(blocks) if self.stacked else nnx.List(blocks)
            self.lnf = nnx.LayerNorm(d, dtype=bf16, rngs=rngs)

        def __call__(self, tokens):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
            if self.stacked:
                x = self.blocks(x)
            else:
                for block in self.blocks:
                    x = block(x)
            return self.wte.attend(self.lnf(x)).astype(jnp.float32)

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]
        ).mean()

    class ScanBlocks(nnx.Module):
        """Flax's own scan over layers (the peer idiom): blocks made by
        ``nnx.vmap``, applied by ``nnx.scan`` under ``nnx.remat`` with the
        policy ``Stack`` uses off CPU."""

        def __init__(self, rngs):
            @nnx.split_rngs(splits=cfg["layers"])
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            policy = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat(policy=policy)
            def layer(x, block):
                return block(x)

            return layer(x, self.layers)

    class RematBlocks(nnx.Module):
        """The unrolled blocks, each under ``nnx.remat`` with the policy
        ``Stack`` uses on this backend: what that policy costs without a scan."""

        def __init__(self, blocks):
            self.blocks = nnx.List(blocks)

        def __call__(self, x):
            from scanax import _backend
            from scanax._stack import default_policy

            policy = default_policy(_backend.platform())
            for block in self.blocks:
                x = nnx.remat(lambda b, x: b(x), policy=policy)(block, x)
            return x

    def build(stack):
        if stack == "unrolled, remat":
            return build(RematBlocks)
        if stack == "nnx.scan":
            model = GPT(nnx.Rngs(0), lambda blocks: ScanBlocks(nnx.Rngs(0)))
        else:
            model = GPT(nnx.Rngs(0), stack)
        return model, nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    # FLOPs per step: 6 per parameter of every matmul (the tied head included)
    # and token, plus attention's 12 * layers * T * d per token.
    matmul_params = cfg["layers"] * 12 * d * d + vocab * d
    tokens = cfg["batch"] * t
    flops = tokens * (6 * matmul_params + 12 * cfg["layers"] * t * d)
    return cfg, build, loss_fn, flops, tokens


def gpt2_rows():
    from flax import nnx

    from scanax._fit.memory import call_bytes

    cfg, build, loss_fn, flops, tokens = _gpt2_parts()
    data = jax.random.randint(
        jax.random.key(0), (cfg["batch"] * 8, cfg["t"] + 1), 0, cfg["vocab"]
    )
    batch = data[: cfg["batch"]]
    dots = jax.checkpoint_policies.checkpoint_dots
    same = "unrolled, each block under Stack's remat policy"
    variants = {
        "unrolled": None,
        "Stack": scanax.Stack,
        "Stack remat=False": lambda b: scanax.Stack(b, remat=False),
        "Stack checkpoint_dots": lambda b: scanax.Stack(b, remat=dots),
        "Stack unroll=2": lambda b: scanax.Stack(b, unroll=2),
        "nnx.scan (Flax's scan over layers)": "nnx.scan",
        same: "unrolled, remat",
    }
    peer = "nnx.scan (Flax's scan over layers)"
    steps, states, info = {}, {}, {}

    def prepare(name):
        model, opt = build(variants[name])
        graphdef, state = nnx.split((model, opt))

        def step(state, tokens, graphdef=graphdef):
            model, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
            opt.update(model, grads)
            return nnx.state((model, opt)), loss

        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
        seconds = time.perf_counter() - t0
        # (the arguments, and beyond them what fit's population groups count:
        # XLA:TPU reports no temporaries, but a peak that holds them)
        need = compiled.memory_analysis().argument_size_in_bytes + call_bytes(compiled)
        steps[name], states[name], info[name] = compiled, state, (seconds, need)

    per_round = 2 if QUICK else 5

    def run(name):
        def call():
            for _ in range(per_round):
                states[name], loss = steps[name](states[name], batch)
            return loss

        return call

    peak = _peak()
    # Groups, each timed interleaved with the unrolled model (six states and
    # programs at once did not fit a 16 GB TPU v5e); a group's own are freed
    # after it.
    groups = (
        ("unrolled", "Stack", peer),
        ("unrolled", "Stack remat=False", "Stack checkpoint_dots", "Stack unroll=2"),
        # (the policy's own cost, apart from the scan's)
        ("unrolled", same, "Stack"),
    )
    for group in groups:
        for name in group:
            if name not in steps:
                prepare(name)
        times = _rounds({k: run(k) for k in group}, rounds=3 if QUICK else 6)
        base = times["unrolled"]
        for name in group:
            step_s = statistics.median(times[name]) / per_round
            seconds, need = info[name]
            mfu = f"{flops / step_s / peak:.1%}" if peak else "n/a (unknown peak)"
            note = (
                f"; {step_s * 1e3:.1f} ms/step, {tokens / step_s:,.0f} tokens/s, "
                f"MFU {mfu}, compile {seconds:.1f} s "
                f"({seconds / info['unrolled'][0]:.2f}x), memory "
                f"{need / 2**20:,.0f} MiB ({need / info['unrolled'][1]:.2f}x)"
            )
            _line(f"GPT-2 step, {name} / unrolled", times[name], base, note)
        if peer in group:
            _line(f"GPT-2 step, Stack / {peer}", times["Stack"], times[peer])
        if same in group:  # (the scan's own share of Stack's step)
            _line("GPT-2 step, Stack / " + same, times["Stack"], times[same])
        for name in group[1:]:
            del steps[name], states[name]
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"GPT-2: device peak in use {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")


def gpt2_fit_rows():
    """fit against the hand-written loop, the same Stack model and batches (a
    part of its own: the variants' states above, 1.5 GB each, left too little
    of a 16 GB TPU v5e for two more models)."""
    from flax import nnx

    cfg, build, loss_fn, flops, tokens = _gpt2_parts()
    data = jax.random.randint(
        jax.random.key(0), (cfg["batch"] * 8, cfg["t"] + 1), 0, cfg["vocab"]
    )
    n = 4 if QUICK else 20
    model, opt = build(scanax.Stack)
    graphdef, state = nnx.split((model, opt))
    hand_state = {"s": state}

    def hand_step(state, tokens):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    hand = jax.jit(hand_step, donate_argnums=0)

    def hand_loop():
        for i in range(n):
            j = (i % 8) * cfg["batch"]
            hand_state["s"], loss = hand(hand_state["s"], data[j : j + cfg["batch"]])
        return loss

    fit_model, fit_opt = build(scanax.Stack)

    def fitted():
        r = scanax.fit(
            fit_model,
            fit_opt,
            loss_fn,
            data,
            steps=n,
            batch_size=cfg["batch"],
            progress=False,
        )
        return r.history["loss"]

    _pair(
        f"GPT-2 fit / hand-written donated jit-step loop, {n} steps",
        fitted,
        hand_loop,
        rounds=3 if QUICK else 5,
    )


# ---------------------------------------------------------------------------- fit


def _mlp(sizes, key):
    keys = jax.random.split(key, len(sizes))
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def _apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def _task(sizes, batch, n_batches=100):
    n = batch * n_batches
    x = jax.random.normal(jax.random.key(1), (n, sizes[0]))
    y = jnp.sin(x[:, : sizes[-1]])

    def loss_fn(p, b):
        return jnp.mean((_apply(p, b[0]) - b[1]) ** 2)

    tx = optax.adam(1e-3)
    p0 = _mlp(sizes, jax.random.key(0))

    order = jax.random.permutation(jax.random.key(2), n)

    def step(carry, i, shuffled=False):
        p, o = carry
        j = i % n_batches
        if shuffled:  # rows drawn through a permutation, as fit's shuffle draws them
            rows = jax.lax.dynamic_slice_in_dim(order, j * batch, batch)
            b = (x[rows], y[rows])
        else:
            b = (
                jax.lax.dynamic_slice_in_dim(x, j * batch, batch),
                jax.lax.dynamic_slice_in_dim(y, j * batch, batch),
            )
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), (loss, g)

    return x, y, loss_fn, tx, p0, step


MLPS = (("tiny", (32, 32, 1), 8), ("small", (784, 256, 10), 64))


def _hand_fused(step, tx, p0, steps, shuffled=False, body=None, jit_init=False):
    """A call of the hand-fused ``jit(lax.scan)`` of ``_task``'s step (its losses
    the scan's output; ``body``: another step over the same carry). Its state
    made eagerly by ``tx.init``, as scripts do; ``jit_init``: by a jitted
    ``tx.init`` (one dispatch, as fit makes it)."""
    if body is None:
        body = lambda c, i: (lambda out: (out[0], out[1][0]))(step(c, i, shuffled))
    run = jax.jit(lambda p, o: jax.lax.scan(body, (p, o), jnp.arange(steps)))
    init = jax.jit(tx.init) if jit_init else tx.init
    return lambda: run(p0, init(p0))


def _finite_select(step):
    """``step`` (``_task``'s) with fit's own non-finite test (``finite``: the
    loss, and each gradient leaf's largest magnitude) and a select per state
    leaf: the carry kept where the step was not finite. ``(carry, loss)``."""
    from scanax._fit.program import finite

    def body(c, i):
        new, (loss, g) = step(c, i)
        loss_ok, grads_ok = finite(loss, g)
        ok = loss_ok & grads_ok
        return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, c), loss

    return body


def _chunked(step, k, between=None):
    """A jitted ``run(carry, n) -> (carry, v)``: ``_task``'s ``step`` in chunks
    of ``k`` (each a ``lax.scan``, a static trip count) inside a ``while_loop``
    to step ``n``, as fit's calls run; ``between(carry, t)``: work at the end
    of each chunk (after step ``t - 1``), its float32 result carried as ``v``."""

    def run(c, n):
        def chunk(s):
            i, c, v = s
            c, _ = jax.lax.scan(
                lambda c, j: (step(c, i + j)[0], None), c, jnp.arange(k)
            )
            if between is not None:
                v = between(c, i + k)
            return i + k, c, v

        return jax.lax.while_loop(lambda s: s[0] < n, chunk, (0, c, jnp.float32(0)))[1:]

    return jax.jit(run)


def _fit_mlp(x, y, loss_fn, tx, p0, steps, batch, **kw):
    kw.setdefault("progress", False)
    return scanax.fit(p0, tx, loss_fn, (x, y), steps=steps, batch_size=batch, **kw)


def fit_rows():
    steps = 200 if QUICK else 1000
    for name, sizes, batch in MLPS:
        x, y, loss_fn, tx, p0, step = _task(sizes, batch)
        hand = _hand_fused(step, tx, p0, steps)

        def ours(**kw):
            r = _fit_mlp(x, y, loss_fn, tx, p0, steps, batch, **kw)
            return r.model

        _pair(f"fit / hand-fused jit(lax.scan), {name} MLP, {steps} steps", ours, hand)
        # fit makes the optax state with one compiled call; the script above
        # with eager ``tx.init`` (a dispatch per array): the same, jitted too.
        _pair(
            f"fit / hand-fused with a jitted tx.init, {name} MLP, {steps} steps",
            ours,
            _hand_fused(step, tx, p0, steps, jit_init=True),
        )
        # With a key, fit shuffles (a gather of each batch's rows): the same
        # work by hand. (Without one, as above, it slices batches in order.)
        _pair(
            f"fit key= (shuffled) / hand-fused jit(lax.scan) drawing shuffled "
            f"rows, {name} MLP, {steps} steps",
            lambda: ours(key=jax.random.key(2)),
            _hand_fused(step, tx, p0, steps, shuffled=True),
        )
        val = (x[: 4 * batch], y[: 4 * batch])
        options = dict(
            eval_data=val,
            eval_every=steps // 10,
            progress=True,
            stop=scanax.EarlyStop("val_loss", patience=steps),
        )
        _pair(
            f"fit with evaluation + progress bar + EarlyStop / hand-fused, {name} "
            f"MLP, {steps} steps",
            lambda: ours(**options),
            hand,
        )
        _pair(
            f"fit stepwise / fused, {name} MLP, {steps} steps",
            lambda: ours(execution="stepwise"),
            ours,
        )
        long = 500 if QUICK else 20_000
        r = scanax.fit(
            p0,
            tx,
            loss_fn,
            (x, y),
            steps=long,
            batch_size=batch,
            progress=False,
            execution="auto",
        )
        print(f"fit execution=auto chose: {r.execution} ({name} MLP, {long} steps)")


_FIRST = """
import time, jax, jax.numpy as jnp, numpy as np, optax, scanax
sizes, batch, steps = {sizes}, {batch}, {steps}
keys = jax.random.split(jax.random.key(0), len(sizes))
p0 = [{{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}}
      for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
x = jax.random.normal(jax.random.key(1), (batch * 100, sizes[0]))
y = jnp.sin(x[:, : sizes[-1]])
def apply(p, x):
    for layer in p[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ p[-1]["w"] + p[-1]["b"]
def loss_fn(p, b):
    return jnp.mean((apply(p, b[0]) - b[1]) ** 2)
tx = optax.adam(1e-3)
jax.block_until_ready((p0, x, y))
t0 = time.perf_counter()
if {ours}:
    r = scanax.fit(p0, tx, loss_fn, (x, y), steps=steps, batch_size=batch,
                   progress=False)
    jax.block_until_ready(r.model)
else:
    def step(c, i):
        p, o = c
        j = i % 100
        b = (jax.lax.dynamic_slice_in_dim(x, j * batch, batch),
             jax.lax.dynamic_slice_in_dim(y, j * batch, batch))
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss
    out = jax.jit(lambda p, o: jax.lax.scan(step, (p, o), jnp.arange(steps)))(
        p0, tx.init(p0))
    jax.block_until_ready(out)
print(time.perf_counter() - t0)
"""


def first_call_rows():
    steps = 200 if QUICK else 1000
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}
    for name, sizes, batch in MLPS:

        def first(ours):
            code = _FIRST.format(sizes=sizes, batch=batch, steps=steps, ours=ours)
            out = subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if out.returncode:
                raise RuntimeError(out.stderr[-2000:])
            return float(out.stdout.strip().splitlines()[-1])

        ours, hand = [], []
        for _ in range(1 if QUICK else 3):  # interleaved fresh processes
            ours.append(first(True))
            hand.append(first(False))
        _line(
            f"fit first call / hand-fused first call, fresh processes, {name} MLP, "
            f"{steps} steps",
            ours,
            hand,
        )


def _device_ms(fn, calls: int = 3) -> dict[str, float]:
    """Each program ``fn`` runs, by name: its device time per call (ms), read
    from a ``jax.profiler`` trace of ``calls`` calls (the devices' "XLA
    Modules" lines; a device without them: the kernels of its streams, as
    "kernels"). Empty where the trace holds no device line (a CPU)."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                _block(fn())
        paths = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))
        data = ProfileData.from_file(paths[-1])
    out: dict[str, float] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = {line.name: line for line in plane.lines}
        modules = lines.get("XLA Modules")
        streams = [v for k, v in lines.items() if k.startswith("Stream")]
        for line in [modules] if modules is not None else streams:
            for e in line.events:
                name = e.name.split("(")[0] if modules is not None else "kernels"
                out[name] = out.get(name, 0.0) + e.duration_ns / 1e6 / calls
    return out


def fit_device_rows():
    """fit's call and the hand-fused call (its ``tx.init`` jitted, as fit
    makes the state) in device time, from a profiler trace: each program's
    time on the device per call, and fit's ÷ the hand-fused scan's. Where the
    1000-step rows' ratio is spent: on the device (per step) or on the host
    (the rest of the call's wall time). On a TPU v5e (tiny MLP, 1000 steps):
    7.03 ms against 5.47 on the device, 1.285x, the call 1.26x, with fit's
    gradients tested each step; with its marks, 4.83 ms, 0.884x, the call
    0.99x."""
    steps = 200 if QUICK else 1000
    for name, sizes, batch in MLPS:
        x, y, loss_fn, tx, p0, step = _task(sizes, batch)
        fns = {
            "fit": lambda: _fit_mlp(x, y, loss_fn, tx, p0, steps, batch).model,
            "hand-fused": _hand_fused(step, tx, p0, steps, jit_init=True),
        }
        for fn in fns.values():
            _block(fn())
        ms = {k: _device_ms(fn) for k, fn in fns.items()}
        if not any(ms.values()):
            print(f"{name} MLP: no device lines in the trace (a CPU)", flush=True)
            continue
        for k, programs in ms.items():
            listed = ", ".join(f"{p} {t:.3f}" for p, t in programs.items())
            print(f"{name} MLP, {steps} steps, {k} on the device (ms/call): {listed}")
        fit, hand = sum(ms["fit"].values()), sum(ms["hand-fused"].values())
        print(
            f"{name} MLP, {steps} steps, fit / hand-fused in device time: "
            f"{fit / hand:.3f} ({fit:.3f} ms vs {hand:.3f} ms)",
            flush=True,
        )


def fit_call_rows():
    """What a call costs beyond its steps: fit and the hand-fused script (its
    ``tx.init`` jitted, as fit makes the state) at 8 steps, and fit's call in
    phases (diagnostic hooks on fit's internals, this part alone): the host
    before the compiled launch, the launch, the wait and read of its results,
    the host after."""
    from scanax._fit import engine, schedule

    steps = 8
    x, y, loss_fn, tx, p0, step = _task(*MLPS[0][1:])
    hand = _hand_fused(step, tx, p0, steps, jit_init=True)
    ours = lambda: _fit_mlp(x, y, loss_fn, tx, p0, steps, MLPS[0][2]).model
    _pair(
        f"fit / hand-fused with a jitted tx.init, tiny MLP, {steps} steps", ours, hand
    )
    marks: dict = {}
    get, device_get = schedule.Execution.get, engine.jax.device_get

    def timed_get(self, mode, compile):
        fn = get(self, mode, compile)

        def launch(*args):
            marks.setdefault("launch", time.perf_counter())
            out = fn(*args)
            marks.setdefault("launched", time.perf_counter())
            return out

        return launch

    def timed_read(tree):
        out = device_get(tree)
        marks.setdefault("read", time.perf_counter())
        return out

    schedule.Execution.get, engine.jax.device_get = timed_get, timed_read
    phases: dict = {k: [] for k in ("host before", "launch", "wait + read", "after")}
    try:
        for _ in range(3 if QUICK else 30):
            marks.clear()
            began = time.perf_counter()
            _block(ours())
            end = time.perf_counter()
            t = [began, marks["launch"], marks["launched"], marks["read"], end]
            for got, a, b in zip(phases.values(), t, t[1:]):
                got.append(b - a)
    finally:
        schedule.Execution.get, engine.jax.device_get = get, device_get
    print(
        f"fit's call in phases, tiny MLP, {steps} steps (median ms): "
        + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in phases.items()),
        flush=True,
    )


def _flagged(step, tx, p0, steps):
    """A call of the hand-fused scan of ``step`` (``_task``'s) with fit's
    per-step non-finite test and no select: a flag carried, the state updated
    whatever the test says (fit's guard on CPU, whose loop exits after a bad
    step; before the marks, off CPU too)."""
    from scanax._fit.program import finite

    def body(s, i):
        c, bad = s
        new, (loss, g) = step(c, i)
        loss_ok, grads_ok = finite(loss, g)
        return (new, bad | ~(loss_ok & grads_ok)), loss

    run = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(steps)))
    return lambda: run(((p0, tx.init(p0)), jnp.array(False)))


def _marking(step, tx, p0, steps):
    """A call of the hand-fused scan of ``step`` with fit's guard off CPU:
    the loss tested each step, each gradient marking the parameter it trains
    (``marked``), the parameters tested once after the loop (``intact``)."""
    from scanax._fit.program import intact, marked

    n = len(jax.tree_util.tree_leaves(p0))

    def body(s, i):
        c, bad = s
        new, (loss, g) = step(c, i)
        leaves, tree = jax.tree_util.tree_flatten(new)
        leaves, _ = marked(leaves, list(range(n)), g)
        return (
            jax.tree_util.tree_unflatten(tree, leaves),
            bad | ~jnp.isfinite(loss),
        ), loss

    def call(c):
        (c1, bad), losses = jax.lax.scan(body, c, jnp.arange(steps))
        before = jax.tree_util.tree_leaves(c[0][0])
        ok = intact(before, jax.tree_util.tree_leaves(c1[0]))
        return c1, bad | ~ok, losses

    run = jax.jit(call)
    return lambda: run(((p0, tx.init(p0)), jnp.array(False)))


def fit_piece_rows():
    """Where fit's time goes on this device, 1000 steps ÷ the hand-fused scan:
    the hand-fused scan with one of fit's per-step pieces added (the shuffled
    rows' gather, the non-finite test with a select per leaf, the same test
    with no select, as fit's loop runs it on CPU, the gradients' marks and one
    test a call, as it runs off CPU), and fit as
    planned here against fit planned as on CPU (one step per iteration, no
    masks), bare and with evaluation and ``EarlyStop``."""
    from scanax import _backend

    steps = 200 if QUICK else 1000
    real = _backend.platform
    for name, sizes, batch in MLPS:
        x, y, loss_fn, tx, p0, step = _task(sizes, batch)
        val = (x[: 4 * batch], y[: 4 * batch])

        def fit(platform, **kw):
            def call():
                _backend.platform = (lambda: platform) if platform else real
                try:
                    return _fit_mlp(x, y, loss_fn, tx, p0, steps, batch, **kw).model
                finally:
                    _backend.platform = real

            return call

        checks = lambda: [
            scanax.Eval(val, every=steps // 10),
            scanax.EarlyStop("val_loss", patience=steps),
        ]

        fns = {
            "hand-fused": _hand_fused(step, tx, p0, steps),
            "+ shuffled gather (fit's with key=)": _hand_fused(
                step, tx, p0, steps, shuffled=True
            ),
            "+ non-finite select": _hand_fused(
                step, tx, p0, steps, body=_finite_select(step)
            ),
            "+ non-finite test, no select (fit's on CPU)": _flagged(
                step, tx, p0, steps
            ),
            "+ gradients' marks, one test a call (fit's off CPU)": _marking(
                step, tx, p0, steps
            ),
            "fit, this backend's plan": fit(None),
            "fit, one step per iteration": fit("cpu"),
            "fit + evaluation + EarlyStop, this backend's plan": fit(
                None, callbacks=checks()
            ),
            "fit + evaluation + EarlyStop, one step per iteration": fit(
                "cpu", callbacks=checks()
            ),
        }
        times = _rounds(fns)
        hand = times.pop("hand-fused")
        for label, t in times.items():
            _line(f"{name} MLP, {steps} steps, {label} / hand-fused", t, hand)


def fit_slope_rows():
    """fit's time split into per step and per call: each candidate timed at 1024
    and 4096 steps (interleaved), the slope ÷ the hand-fused scan's slope, and
    the intercept (what a call costs whatever its length: setup, dispatches,
    reads, the optimizer's init; the hand-fused call's includes its
    ``tx.init``). Next to them, the hand-fused scan as chunks of 64 in a
    ``while_loop``, bare and evaluating every 128 steps behind a ``lax.cond``
    or in a loop of at most one trip (``scanax._once.once_if``, as fit's
    chunked loop now does): on a TPU v5e a conditional anywhere in the loop
    moved a small model's training state from on-chip memory to HBM (1.55x per
    step for the 784-256-10 MLP), the one-trip loop did not (0.99x)."""
    from scanax._once import branch_free, once_if

    lengths = (256, 1024) if QUICK else (1024, 4096)
    for name, sizes, batch in MLPS:
        x, y, loss_fn, tx, p0, step = _task(sizes, batch)
        val = (x[: 4 * batch], y[: 4 * batch])
        every = 128  # (a multiple of the chunks of 64)

        plain = _chunked(step, 64)

        def evaluation(loop):
            def between(c, t):
                with branch_free(loop):  # (False: a lax.cond)
                    return once_if(
                        t % every == 0,
                        lambda c: loss_fn(c[0], val),
                        lambda c: jnp.float32(jnp.nan),
                        c,
                    )

            return _chunked(step, 64, between)

        conditional, one_trip = evaluation(False), evaluation(True)

        def chunked(run, steps):
            return lambda: run((p0, tx.init(p0)), steps)

        medians = {}
        for steps in lengths:
            cands = {
                "hand-fused": _hand_fused(step, tx, p0, steps),
                "fit": lambda: _fit_mlp(x, y, loss_fn, tx, p0, steps, batch).model,
                f"fit + Eval every {every}": lambda: (
                    _fit_mlp(
                        x,
                        y,
                        loss_fn,
                        tx,
                        p0,
                        steps,
                        batch,
                        callbacks=[scanax.Eval(val, every=every)],
                    ).model
                ),
                "hand, while over scans of 64": chunked(plain, steps),
                f"hand, while over scans of 64 + cond every {every}": chunked(
                    conditional, steps
                ),
                f"hand, while over scans of 64 + one-trip loop every {every}": (
                    chunked(one_trip, steps)
                ),
            }
            times = _rounds(cands)
            medians[steps] = {k: statistics.median(v) for k, v in times.items()}
        a, b = lengths
        per_step = {k: (medians[b][k] - medians[a][k]) / (b - a) for k in medians[a]}
        for label, s in per_step.items():
            fixed = medians[a][label] - s * a
            print(
                f"{name} MLP, {label}: per step {s / per_step['hand-fused']:.2f}x "
                f"hand-fused ({s * 1e6:.2f} us), per call {fixed * 1e3:.2f} ms",
                flush=True,
            )


def loop_kind_rows():
    n = 200 if QUICK else 2000
    x, y, loss_fn, tx, p0, step = _task((32, 32, 1), 8)
    plain = lambda c, i: (step(c, i)[0], None)

    def dynamic(body):
        def run(c, n):
            i, c = jax.lax.while_loop(
                lambda ic: ic[0] < n, lambda ic: (ic[0] + 1, body(ic[1], ic[0])), (0, c)
            )
            return c

        return jax.jit(run)

    c0 = (p0, tx.init(p0))
    scan = jax.jit(lambda c: jax.lax.scan(plain, c, jnp.arange(n))[0])
    while_ = dynamic(lambda c, i: plain(c, i)[0])
    chunks = _chunked(step, 10)
    checked = dynamic(lambda c, i: _finite_select(step)(c, i)[0])
    kinds = {
        "lax.scan (static trip count)": lambda: scan(c0),
        "lax.while_loop, dynamic bound": lambda: while_(c0, n),
        "while_loop over lax.scan chunks of 10": lambda: chunks(c0, n),
        "dynamic while_loop + fit's non-finite test and select": lambda: checked(c0, n),
        "scanax.fit": lambda: (
            scanax.fit(
                p0, tx, loss_fn, (x, y), steps=n, batch_size=8, progress=False
            ).model
        ),
    }
    times = _rounds(kinds)
    base = times["lax.scan (static trip count)"]
    for name, t in times.items():
        us = statistics.median(t) / n * 1e6
        _line(
            f"loop kind, tiny-MLP Adam, {n} steps, {name} / lax.scan",
            t,
            base,
            f"; {us:.2f} µs/step",
        )


# ------------------------------------------------------------------- side by side


def side_by_side_rows():
    from flax import nnx

    n = 200 if QUICK else 2000
    sizes, batch = (784, 512, 512, 10), 128
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(batch * 100, sizes[0])).astype(np.float32)
    y_np = rng.integers(0, 10, size=batch * 100).astype(np.int32)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
            )

        def __call__(self, h):
            for layer in self.layers[:-1]:
                h = jax.nn.relu(layer(h))
            return self.layers[-1](h)

    def loss_fn(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b[0]), b[1]).mean()

    def fresh():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    fm, fo = fresh()
    scanax.fit(fm, fo, loss_fn, (x, y), steps=n, batch_size=batch, progress=False)

    def fit_second():
        return scanax.fit(
            fm, fo, loss_fn, (x, y), steps=n, batch_size=batch, progress=False
        ).history["loss"]

    hm, ho = fresh()
    graphdef, hstate = nnx.split((hm, ho))

    def one(state, i):
        model, opt = nnx.merge(graphdef, state)
        j = (i % 100) * batch
        b = (
            jax.lax.dynamic_slice_in_dim(x, j, batch),
            jax.lax.dynamic_slice_in_dim(y, j, batch),
        )
        loss, g = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, g)
        return nnx.state((model, opt)), loss

    fused = jax.jit(lambda s: jax.lax.scan(one, s, jnp.arange(n)))
    box = {"s": hstate}

    def hand_fused():
        box["s"], losses = fused(box["s"])
        return losses

    lm, lo = fresh()

    @nnx.jit
    def nnx_step(model, opt, xb, yb):
        loss, g = nnx.value_and_grad(loss_fn)(model, (xb, yb))
        opt.update(model, g)
        return loss

    def python_loop():
        for i in range(n):
            j = (i % 100) * batch
            loss = nnx_step(lm, lo, x[j : j + batch], y[j : j + batch])
        return loss

    cands = {
        "fit (second call)": fit_second,
        "hand-fused scan": hand_fused,
        "Python loop of nnx.jit steps": python_loop,
    }
    cands.update(_torch_candidates(x_np, y_np, sizes, batch, n))
    times = _rounds(cands, rounds=2 if QUICK else 5)
    base = times["fit (second call)"]
    for name, t in times.items():
        us = statistics.median(t) / n * 1e6
        _line(
            f"784-512-512-10 MLP, Adam, batch 128, {n} steps, {name} / fit",
            t,
            base,
            f"; {us:.1f} µs/step",
        )


def _torch_candidates(x_np, y_np, sizes, batch, n) -> dict:
    try:
        import torch
    except ImportError:
        print(
            "side by side: torch is not installed: PyTorch and Lightning rows skipped"
        )
        return {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def net():
        torch.manual_seed(0)
        mods = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods[:-1]).to(dev)

    xt, yt = torch.from_numpy(x_np).to(dev), torch.from_numpy(y_np).long().to(dev)
    model = net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)

    def eager():
        for i in range(n):
            j = (i % 100) * batch
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(
                model(xt[j : j + batch]), yt[j : j + batch]
            )
            loss.backward()
            opt.step()
        sync()
        return None

    out = {f"PyTorch eager loop ({dev})": eager}
    try:
        import lightning as L
    except ImportError:
        try:
            import pytorch_lightning as L
        except ImportError:
            print("side by side: lightning is not installed: Lightning row skipped")
            return out
    data = torch.utils.data.TensorDataset(
        torch.from_numpy(x_np), torch.from_numpy(y_np).long()
    )

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, b, i):
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    def lightning():
        trainer = L.Trainer(
            max_steps=n,
            accelerator="auto",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
        trainer.fit(Module(), loader)
        sync()

    out["Lightning Trainer.fit"] = lightning
    return out


# ---------------------------------------------------------------------------- scans


def linear_rows():
    batch = 8 if QUICK else 1024
    methods = ("sequential", "associative", "chunked")
    for t in (64, 128) if QUICK else (1024, 4096):
        shape = (t, batch, 16)
        a = jax.random.uniform(jax.random.key(0), shape, minval=0.5, maxval=0.99)
        b = jax.random.normal(jax.random.key(1), shape)

        def ref(a, b):
            def f(h, ab):
                h = ab[0] * h + ab[1]
                return h, h

            return jax.lax.scan(f, jnp.zeros_like(b[0]), (a, b))[1]

        fns = {"lax.scan": jax.jit(ref)}
        for m in (*methods, "auto"):
            fns[m] = jax.jit(lambda a, b, m=m: scanax.linear_scan(a, b, method=m)[0])
        for kind in ("forward", "gradient"):
            if kind == "gradient":
                fns = {
                    k: jax.jit(
                        jax.grad(lambda a, b, f=f: jnp.sum(f(a, b) ** 2), (0, 1))
                    )
                    for k, f in fns.items()
                }
            methods_only = {k: f for k, f in fns.items() if k != "auto"}
            times = _rounds({k: (lambda f=f: f(a, b)) for k, f in methods_only.items()})
            base = times["lax.scan"]
            ratios = {m: _ratio(times[m], base) for m in methods}
            best = min(methods, key=lambda m: ratios[m][0])
            cells = ", ".join(
                f"{m} {ratios[m][0]:.3f} [{ratios[m][1]:.2f}-{ratios[m][2]:.2f}]"
                for m in methods
            )
            print(
                f"linear_scan / lax.scan, batch {batch}, T={t}, {kind}: {cells}",
                flush=True,
            )
            # auto against the best as a pair of its own: in one round robin, the
            # call right after the associative scan's memory traffic runs slower.
            pair = _rounds({k: (lambda f=fns[k]: f(a, b)) for k in ("auto", best)})
            _line(
                f"linear_scan auto / best ({best}), batch {batch}, T={t}, {kind}",
                pair["auto"],
                pair[best],
            )


def linear_hand_rows():
    """``method="associative"`` ÷ the hand-written scan (minimal LRU shapes)."""
    try:
        from benchmarks import bench_linear
    except ImportError:  # run as a script: benchmarks/ is on the path
        import bench_linear  # type: ignore[no-redef]

    shapes = ((256, 16),) if QUICK else ((1024, 64), (4096, 256))
    for t, n in shapes:
        for row in bench_linear._hand_rows(t, n, 3 if QUICK else 7):
            print(
                f"{row['case']}: {row['ratio']:.3f} ({row['scanax']:.4g} s vs "
                f"{row['baseline_value']:.4g} s; {row['notes']})",
                flush=True,
            )


def scan_overhead():
    w = jax.random.normal(jax.random.key(0), (128, 128)) / 12

    def body(h, _):
        return jnp.tanh(h @ w), None

    h0 = jnp.ones((8, 128))
    n = 100 if QUICK else 10_000
    ours = jax.jit(lambda h: scanax.scan(body, h, None, length=n)[0])
    theirs = jax.jit(lambda h: jax.lax.scan(body, h, None, length=n)[0])
    _pair(
        f"scanax.scan / lax.scan, matmul body, {n} steps",
        lambda: ours(h0),
        lambda: theirs(h0),
    )


def rnn_rows():
    from flax import nnx

    cells = [nnx.GRUCell(64, 64, rngs=nnx.Rngs(i)) for i in range(4)]
    t = 16 if QUICK else 256
    x = jax.random.normal(jax.random.key(0), (t, 32, 64))

    def loss(cells, order):
        return jnp.sum(scanax.rnn(cells, x, order=order)[1] ** 2)

    grads = {o: nnx.jit(nnx.grad(lambda c, o=o: loss(c, o))) for o in ("time", "layer")}
    _pair(
        f"rnn order='time' / order='layer', 4-layer GRU, T {t}, fwd+bwd",
        lambda: grads["time"](cells),
        lambda: grads["layer"](cells),
    )


def conv_rows():
    x = jax.random.normal(jax.random.key(0), (32, 8, 8, 1))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)
    k1 = jax.random.normal(jax.random.key(2), (3, 3, 1, 16)) * 0.3
    k2 = jax.random.normal(jax.random.key(3), (3, 3, 16, 32)) * 0.1
    wd = jax.random.normal(jax.random.key(4), (8 * 8 * 32, 10)) * 0.01
    p0 = {"k1": k1, "k2": k2, "wd": wd}
    tx = optax.adam(1e-3)
    dn = ("NHWC", "HWIO", "NHWC")

    def loss_fn(p):
        conv = lambda h, k: jax.lax.conv_general_dilated(
            h, k, (1, 1), "SAME", dimension_numbers=dn
        )
        h = jax.nn.relu(conv(jax.nn.relu(conv(x, p["k1"])), p["k2"]))
        logits = h.reshape(32, -1) @ p["wd"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(c, _):
        p, o = c
        u, o = tx.update(jax.grad(loss_fn)(p), o, p)
        return (optax.apply_updates(p, u), o), None

    for n in (10, 40) if QUICK else (200, 2000):
        ours = jax.jit(lambda: scanax.scan(step, (p0, tx.init(p0)), None, length=n)[0])
        theirs = jax.jit(
            lambda: jax.lax.scan(step, (p0, tx.init(p0)), None, length=n)[0]
        )
        _pair(f"scanax.scan / lax.scan, small CNN Adam step, {n} steps", ours, theirs)


# ---------------------------------------------------------------------------- main


PARTS = (
    gpt2_rows,
    gpt2_fit_rows,
    fit_rows,
    loop_kind_rows,
    side_by_side_rows,
    linear_rows,
    linear_hand_rows,
    scan_overhead,
    rnn_rows,
    conv_rows,
    # where fit's time goes (no README target of their own): last, so that a
    # device that runs past the budget skips these first (the device-time
    # split first among them: it says whether fit's gap is the device's)
    fit_device_rows,
    fit_slope_rows,
    fit_call_rows,
    fit_piece_rows,
)


def main() -> int:
    # Parts named on the command line (``python benchmarks/device_check.py
    # linear_rows conv_rows``): those alone; none named: every part.
    named = [a for a in sys.argv[1:] if not a.startswith("--")]
    unknown = set(named) - {p.__name__ for p in (first_call_rows, *PARTS)}
    if unknown:
        sys.exit(f"device_check: no part named {sorted(unknown)}")
    wanted = lambda part: not named or part.__name__ in named
    # The fresh processes first, before this one touches the device: a TPU admits
    # one process at a time (libtpu's lock file), and this one holds it from its
    # first array on; there each process's opening of the chip (about 15 s) is in
    # its row. A chip just let go can refuse the next process for a moment. The
    # budget starts after them.
    if wanted(first_call_rows):
        _part(first_call_rows, time.perf_counter())
        time.sleep(5)
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    print(
        f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d')}{', --quick' if QUICK else ''}",
        flush=True,
    )
    for part in filter(wanted, PARTS):
        _part(part, t0)
    print(f"total: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def _part(part, t0: float) -> None:
    began = time.perf_counter()
    if began - t0 > BUDGET:
        print(f"{part.__name__}: skipped (past the {BUDGET:.0f} s budget)")
        return
    try:
        part()
    except Exception as err:  # noqa: BLE001 - report and go on
        print(f"{part.__name__}: failed: {type(err).__name__}: {err}", flush=True)
    print(f"  ({part.__name__}: {time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
