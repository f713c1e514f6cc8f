"""Messages of ``scanax.fit``'s errors: arguments and options, data, checkpoints
and meshes, a step's warnings (the model kinds' messages are in ``models``)."""

from __future__ import annotations

import difflib
import math
from typing import Any

import jax.tree_util as jtu

from . import listing, short_type

CALL = "scanax.fit"


def loss_fn_not_callable(loss_fn: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` must be callable as loss_fn(model, batch) -> loss, "
        f"got {short_type(loss_fn)}.\nFix: pass the loss function third: "
        "fit(model, optimizer, loss_fn, data, steps=...)."
    )


def extra_positional(
    call: str, names: tuple[str, ...], extra: tuple, keyword: str
) -> TypeError:
    """More positional arguments than ``names`` (Keras's ``fit(x, y)``, or
    ``steps`` given by position): what came after the data, and how to pass it."""
    short = call.rpartition(".")[2]
    data, fn = names[-1], names[-2]
    head = (
        f"{call} takes {len(names)} positional arguments ({', '.join(names)}), "
        f"got {len(names) + len(extra)}: after `{data}` came "
        f"{', '.join(short_type(x) for x in extra)}."
    )
    first = extra[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return TypeError(
            f"{head}\nFix: the options after `{data}` are keywords: "
            f"{short}({', '.join(names)}, {keyword}={first!r}, ...)."
        )
    if hasattr(first, "shape") or isinstance(first, (list, tuple, dict)):
        return TypeError(
            f"{head}\nFix: `{data}` is one argument (Keras's fit(x, y) becomes "
            f"{{'x': x, 'y': y}} here): a pytree whose arrays share their "
            f"leading (example) axis, e.g. {short}({', '.join(names[:-1])}, "
            f"{{'x': x, 'y': y}}, ...), with {fn}(model, batch) reading "
            "batch['x'] and batch['y']."
        )
    return TypeError(
        f"{head}\nFix: pass `{data}` as one argument and name the options after "
        f"it: {short}({', '.join(names)}, {keyword}=..., ...)."
    )


def checkpoint_every_without_dir(checkpoint_every: Any) -> TypeError:
    return TypeError(
        f"{CALL}: checkpoint_every={checkpoint_every!r} is given but "
        "checkpoint_dir is None.\nFix: pass checkpoint_dir=... (a directory) "
        "too, or drop checkpoint_every."
    )


def metrics_changed(
    done: int, new: list[str], gone: list[str], who: str, what: str, per: str
) -> str:
    parts = [f"new {', '.join(new)}"] if new else []
    parts += [f"no longer returned: {', '.join(gone)}"] if gone else []
    return (
        f"{CALL}: {who} returns other metrics than the first {done} {what} of "
        f"the history (from the checkpoint): {'; '.join(parts)}. Each history array "
        f"keeps one entry per {per}, NaN where a metric has no value."
    )


def checkpoint_dir_type(directory: Any) -> TypeError:
    return TypeError(
        "scanax.Checkpoint: its directory (checkpoint_dir=) must be a path (str "
        f"or os.PathLike), got {short_type(directory)}.\nFix: pass a directory "
        "path, e.g. scanax.Checkpoint('runs/ckpt', every=500)."
    )


def checkpoint_dir_not_dir(path: str) -> ValueError:
    return ValueError(
        f"{CALL}: checkpoint_dir {path!r} exists and is not a directory.\nFix: "
        "pass a directory (it is created if missing), not a file."
    )


def batch_leaf_not_numeric(index: int, path: str, leaf: Any) -> TypeError:
    return TypeError(
        f"{CALL}: batch {index} of `data` has batch{path} = {short_type(leaf)}"
        f" {str(leaf)[:40]!r}, which is not numbers: a training batch can only hold "
        "numeric or boolean arrays.\nFix: drop it from the batches (encode strings "
        "as integer ids first)."
    )


def data_leaf_not_array(path: str, leaf: Any) -> TypeError:
    return TypeError(
        f"{CALL}: data{path} is {short_type(leaf)}, not an array, next to arrays in "
        "`data`. Array data is a pytree of arrays sharing a leading example axis.\n"
        f"Fix: drop data{path} from `data` (close over it in `loss_fn` instead), or "
        "make it an array with one entry per example."
    )


def data_list_not_array(path: str, n: int) -> TypeError:
    return TypeError(
        f"{CALL}: data{path} is a list of {n}, not an array, next to arrays in "
        "`data`. Array data is a pytree of arrays sharing a leading example axis.\n"
        f"Fix: make it one array: jnp.asarray(data{path}) (or np.asarray)."
    )


def data_leading_axes(leaves: list[tuple[Any, Any]], name: str = "data") -> ValueError:
    """``leaves``: ``(path, array)`` pairs of the data (``name``: or
    ``eval_data``)."""
    body = listing(
        [
            (
                f"{name}{jtu.keystr(p)}",
                f"{short_type(x)}: {x.shape[0] if x.ndim else 'no leading axis'}",
            )
            for p, x in leaves
        ]
    )
    return ValueError(
        f"{CALL}: the arrays in `{name}` must share their leading (example) "
        f"axis, found:\n{body}\nFix: give every leaf the same number of "
        "examples along axis 0."
    )


def data_not_numeric(
    leaves: list[tuple[Any, Any]], name: str = "data", call: str = CALL
) -> TypeError:
    """``leaves``: ``(path, array)`` pairs JAX cannot hold (strings, objects)."""
    body = listing(
        [(f"{name}{jtu.keystr(p)}", f"{x.dtype} {list(x.shape)}") for p, x in leaves]
    )
    return TypeError(
        f"{call}: `{name}` holds arrays JAX cannot put on a device (strings, "
        f"objects or dates):\n{body}\nFix: encode them as numbers (strings as "
        "integer ids of a vocabulary, e.g. np.unique(x, return_inverse=True)[1]), "
        "or leave them out of the data."
    )


def batch_size_missing(n: int) -> TypeError:
    return TypeError(
        f"{CALL}: `data` is a pytree of arrays ({n} examples) but "
        "`batch_size` is None.\nFix: pass batch_size=... (examples per step), "
        "or pass an iterable of ready-made batches as `data`."
    )


def short_batch_ends(index: int, n: int, first: int) -> str:
    return (
        f"{CALL}: batch {index} of `data` has {n} examples where the first had "
        f"{first} (an incomplete last batch: a PyTorch DataLoader's default "
        "drop_last=False): training ended before it, as when data runs out (one "
        "compiled program takes one batch shape).\nFix: drop it at the source "
        "(DataLoader(..., drop_last=True), Grain's batch(..., drop_remainder=True))"
        " to end without this warning."
    )


def micro_batches_left(left: int, k: int) -> str:
    return (
        f"{CALL}: `data` ended with {left} batch{'es' if left > 1 else ''} after "
        f"the last full group of accumulate={k}: a step takes {k} batches, so "
        "training ended before them (they are not trained on).\nFix: give a "
        f"number of batches that {k} divides, or drop the last ones at the "
        "source, to end without this warning."
    )


def data_gave_no_batch(steps: int) -> str:
    return (
        f"{CALL}: `data` gave no batch, so none of the {steps} steps ran: it is "
        "empty, or an iterator used up before this call (a generator or "
        "iter(loader) makes one pass).\nFix: pass a new iterator to each call "
        "(make the generator again, or pass the loader itself, whose iter() "
        "starts a new pass), or a list of batches."
    )


def data_empty(name: str, data: Any) -> ValueError:
    shapes = ", ".join(short_type(x) for x in jtu.tree_leaves(data))
    what = "scanax.Eval's data" if name == "eval_data" else "the training data"
    return ValueError(
        f"{CALL}: `{name}` ({what}) has no examples ({shapes}).\nFix: pass at "
        "least one example along axis 0."
    )


def batch_size_too_large(batch_size: int, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: batch_size={batch_size} is larger than the data "
        f"({n} examples along axis 0).\nFix: pass batch_size <= {n}."
    )


def data_not_batches(data: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `data` must be a pytree of arrays (with batch_size) or an "
        f"iterable of batches, got {short_type(data)}.\nFix: pass "
        "arrays with a leading example axis, or an iterator of batches."
    )


def batch_structure_changed(index: int, treedef: Any, first: Any) -> TypeError:
    return TypeError(
        f"{CALL}: batch {index} of `data` has structure {treedef}, but the "
        f"first batch had {first}.\nFix: yield batches of one "
        "structure."
    )


def batch_shape_changed(
    index: int, rows: list[tuple[str, str]], from_list: bool = False
) -> TypeError:
    if from_list:  # data=[x, y]: meant as arrays, read as a list of batches
        return TypeError(
            f"{CALL}: `data` is a list, so each element is one batch, and batch "
            f"{index} differs in shape or dtype from the first:\n{listing(rows)}"
            "\nFix: for arrays with a leading example axis, pass a tuple or dict "
            "and a batch_size: data=(x, y), batch_size=32."
        )
    return TypeError(
        f"{CALL}: batch {index} of `data` differs in shape or dtype from the "
        f"first batch:\n{listing(rows)}\nFix: yield batches of one "
        "shape (drop or pad an incomplete last batch: a PyTorch DataLoader's "
        "drop_last=True, Grain's batch(..., drop_remainder=True))."
    )


def not_positive(name: str, value: int, call: str = CALL) -> ValueError:
    return ValueError(
        f"{call}: `{name}` must be a positive int, got {value}.\nFix: pass "
        f"{name}=1 or more."
    )


def not_int(name: str, value: Any, call: str = CALL) -> TypeError:
    return TypeError(
        f"{call}: `{name}` must be a positive int, got "
        f"{short_type(value)}.\nFix: pass an int, e.g. {name}=100."
    )


def batch_size_with_iterable(data: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `batch_size` is for array data, but `data` is "
        f"{short_type(data)}, read as an iterable of batches.\nFix: "
        "drop batch_size for ready-made batches, or pass a tuple/dict of "
        "arrays with a leading example axis."
    )


def mesh_type(mesh: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `mesh` must be a jax.sharding.Mesh, got "
        f"{short_type(mesh)}.\nFix: pass e.g. "
        "jax.make_mesh((jax.device_count(),), ('data',)), or mesh=None."
    )


def mesh_axis(mesh: Any, axis: str) -> ValueError:
    return ValueError(
        f"{CALL}: `mesh` has axes {tuple(mesh.axis_names)}, but batches are "
        f"sharded over an axis named {axis!r}.\nFix: name the batch axis of the "
        f"mesh {axis!r}."
    )


def batch_not_divisible(what: str, batch_size: int, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: {what} {batch_size} is not divisible by the mesh's 'data' "
        f"axis ({n} devices).\nFix: use a batch size that is a multiple of {n}."
    )


def batch_no_leading_axis(path: str, x: Any) -> ValueError:
    return ValueError(
        f"{CALL}: batch{path} is "
        f"{short_type(x[0])}, with no leading batch axis to shard "
        "over the mesh.\nFix: give every leaf of a batch a leading batch "
        "axis."
    )


# ---------------------------------------------------------------------------- warnings


def nonfinite_step(
    t: int, loss: Any, done: int, restoring: bool = False, held: bool = False
) -> str:
    """Step ``t`` (0-based) was bad: its loss ``loss`` was not finite, or, the
    loss finite, its gradients (or the parameters its update made: the marks
    cannot tell them apart). ``restoring``: an EarlyStop restores its best
    state; ``held``: the state after step ``t`` holds non-finite parameters
    (made by step ``t``'s update, the last of a call, seen by the next call's
    first loss)."""
    if math.isfinite(float(loss)):
        what = "non-finite gradients or parameters"
    else:
        what = f"a non-finite loss ({float(loss)})"
    good = f"after step {t} ({done} good steps in this call)"
    out = f"{CALL}: step {t + 1} gave {what}; training stopped before applying it. "
    if restoring:
        out += (
            f"The last good state is {good}; the result holds EarlyStop's best "
            "state (restore_best=True: result.best_step), or that one if it kept "
            "none."
        )
    else:
        out += f"The result holds the state {good}."
    if held:
        out += (
            f" But the parameters after step {t} are not all finite: the "
            f"update of step {t}, the last of a call, made them so, and only "
            "this step's loss showed it (a call's last update is tested by the "
            "next call's loss), so the state before it is not kept.\nFix: "
            "restore an earlier checkpoint (scanax.Checkpoint) and train with a "
            "smaller learning rate or clipped updates (optax.clip_by_global_norm)."
        )
    return out


# ---------------------------------------------------------------------------- steps


def key_type(key: Any, population: bool = False) -> TypeError:
    if isinstance(key, int) and not isinstance(key, bool):
        fix = f"key=jax.random.key({key})"
    else:
        fix = "key=jax.random.key(seed)"
    one = (
        " A population takes one key too: each member's is split from it."
        if population
        else ""
    )
    return TypeError(
        f"{CALL}: `key` must be one JAX random key, as jax.random.key(seed) "
        "makes (a typed key array of shape ()), or a legacy raw key "
        "(jax.random.PRNGKey(seed): uint32 of the default implementation's key "
        f"shape); got {short_type(key)}.{one}\nFix: pass {fix}; it shuffles the "
        "data and gives the per-step keys."
    )


def loss_key_without_key(param: str) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` takes a third argument, `{param}`, for a per-step "
        "random key (a parameter named key, rng or rngs, with or without a "
        "default, or a third one without a default, is given fit's key), but fit "
        "was called with key=None.\nFix: pass key=jax.random.key(seed); step t "
        "then gets jax.random.fold_in(jax.random.split(key)[1], t). To call it "
        "without a key, pass `lambda model, batch: loss_fn(model, batch)`."
    )


def no_step_count() -> str:
    return (
        f"{CALL}: `opt_state` was made by tx.init, not returned by fit, and tx "
        "keeps no step count of its own (e.g. plain optax.sgd, or "
        "optax.MultiSteps), so this call cannot tell where an earlier one "
        "stopped: the data order and per-step keys start at step 0. To continue "
        "an earlier fit exactly, pass its result.optimizer as opt_state (fit "
        "keeps its own step count there: the state of optax.chain(tx, "
        "optax.scale_by_schedule(lambda step: 1.0)))."
    )


# ---------------------------------------------------------------------------- cache


def cache_dir_unusable(directory: str, err: Exception) -> str:
    return (
        f"scanax.compile_cache: cannot use {directory!r} for compiled programs "
        f"({type(err).__name__}: {err}); continuing without a persistent cache. "
        "Fix: pass a writable directory, or set SCANAX_COMPILE_CACHE=0 to turn it "
        "off."
    )


def eval_option_without_data(name: str) -> TypeError:
    return TypeError(
        f"{CALL}: `{name}` is given without eval_data.\nFix: pass eval_data=(x_val, "
        "y_val) and eval_every=N too, or drop it."
    )


def stop_type(stop: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `stop` must be a scanax.EarlyStop, got {short_type(stop)}.\nFix: "
        'stop=scanax.EarlyStop("val_loss", patience=5).'
    )


def checks_unreached(every: int, steps: int, evaluates: bool, rules: list) -> str:
    named = " and ".join(f"{type(r).__name__}({r.monitor!r})" for r in rules)
    if evaluates:
        what = f"scanax.Eval evaluates every {every} steps"
        lost = "it has no evaluation" + (", " if rules else " and ")
        lost += "history no val_ entries"
        lost += f", and {named} is never checked" if rules else ""
    else:
        what = f"{named} is checked every {every} steps (scanax.Eval's every)"
        lost = "it is never checked"
    return (
        f"{CALL}: {what}, first at step {every}, but this call runs {steps} "
        f"steps: {lost}.\nFix: a smaller every (at most {steps}), or more "
        f"steps; a later fit call continuing this run checks at step {every} "
        "as planned."
    )


def eval_every_missing(has_data: bool) -> TypeError:
    what = (
        "scanax.Eval (eval_data=) is given without `every`"
        if has_data
        else "scanax.EarlyStop (stop=) is given without a scanax.Eval's `every`"
    )
    return TypeError(
        f"{CALL}: {what} (eval_every=), and fit trains by steps, not epochs: "
        "evaluation and the early-stop rule run every `every` steps, inside the "
        "compiled loop.\nFix: pass scanax.Eval((x_val, y_val), every=N) in "
        "callbacks (eval_every=N), e.g. N=100; or train by epochs= (then one "
        "evaluation per epoch)."
        + (
            ""
            if has_data
            else " To stop on a training or rollout metric (no validation "
            "data), pass scanax.Eval(None, every=N)."
        )
    )


def epoch_not_whole_steps(per_epoch: int, accumulate: int) -> ValueError:
    divisors = [d for d in range(1, per_epoch + 1) if per_epoch % d == 0]
    return ValueError(
        f"{CALL}: with epochs=, an evaluation or rule given without `every` runs "
        f"once per epoch, but an epoch of {per_epoch} batches is not a whole "
        f"number of optimizer steps of accumulate={accumulate} batches each: no "
        "step ends an epoch.\nFix: pass scanax.Eval(..., every=N) in steps; or an "
        f"accumulate that divides {per_epoch} ({', '.join(map(str, divisors))}); "
        "or a batch_size that makes the epoch a multiple of accumulate."
    )


def eval_without_data() -> TypeError:
    return TypeError(
        f"{CALL}: scanax.Eval is given without data, and no scanax.EarlyStop or "
        "scanax.Plateau checks training metrics at its steps: it has nothing to "
        "do.\nFix: pass the validation data, scanax.Eval((x_val, y_val), "
        "every=N); or drop it."
    )


def eval_every_without_data() -> TypeError:
    return TypeError(
        f"{CALL}: eval_every is given without eval_data (and without stop=).\nFix: "
        "pass eval_data=(x_val, y_val), or drop eval_every."
    )


def val_monitor_without_data(monitor: str) -> ValueError:
    return ValueError(
        f"{CALL}: scanax.EarlyStop monitors {monitor!r}, a validation metric, but "
        "no scanax.Eval has data (eval_data=).\nFix: pass scanax.Eval((x_val, "
        "y_val), every=N) in callbacks "
        "(eval_data=...), or monitor a training metric such as 'loss'."
    )


def eval_data_not_arrays(data: Any) -> TypeError:
    leaves = jtu.tree_flatten_with_path(data, is_leaf=lambda x: isinstance(x, list))
    found = [
        f"{jtu.keystr(p) or '(the data)'} {short_type(x)}"
        for p, x in leaves[0]
        if not hasattr(x, "shape")
    ]
    where = f" ({', '.join(found[:4])})" if found and not isinstance(data, list) else ""
    return TypeError(
        f"scanax.Eval: the evaluation data must be arrays with a leading example "
        f"axis (a tuple or dict of arrays), got {short_type(data)}{where}: the "
        "whole of it is evaluated inside the compiled loop.\nFix: stack the "
        "validation set into arrays, e.g. scanax.Eval((jnp.asarray(x_val), "
        "jnp.asarray(y_val)), every=100)."
    )


def eval_fn_not_callable(fn: Any) -> TypeError:
    return TypeError(
        "scanax.Eval: `fn` (eval_fn=) must be callable as fn(model, batch) -> "
        f"loss or (loss, metrics), got {short_type(fn)}.\nFix: pass a function, "
        "or leave `fn` out to evaluate loss_fn."
    )


def shard_value(shard: Any, allowed: tuple) -> ValueError:
    return ValueError(
        f"{CALL}: shard={shard!r} is not a sharding rule; expected None "
        f"(replicated state) or one of {', '.join(map(repr, allowed))}.\nFix: pass "
        "shard='fsdp' to split parameters and optimizer state over the mesh's "
        "'data' axis, or leave it out."
    )


def shard_without_mesh(shard: Any) -> ValueError:
    return ValueError(
        f"{CALL}: shard={shard!r} needs a mesh to shard over, but mesh is None.\n"
        "Fix: pass mesh=jax.make_mesh((jax.device_count(),), ('data',)) too."
    )


def shard_with_population(shard: Any) -> ValueError:
    return ValueError(
        f"{CALL}: shard={shard!r} is for one model; a population's members are "
        "split over the mesh's 'members' axis instead.\nFix: drop shard=."
    )


def fsdp_unsharded(rows: list[tuple[str, str]], n: int) -> str:
    return (
        f"{CALL}: shard='fsdp' leaves {len(rows)} state "
        f"{'leaf' if len(rows) == 1 else 'leaves'} replicated: no free axis is "
        f"divisible by the mesh's 'data' size {n}:\n{listing(rows)}\nTo shard "
        "them, give them an axis divisible by it, or a mesh whose 'data' size "
        "divides one of their axes."
    )


def process_unreachable(process: int, seconds: int) -> RuntimeError:
    return RuntimeError(
        f"{CALL}: process {process} did not reach the same point of training "
        f"within {seconds} s; every process of the mesh must call fit with the "
        "same arguments (a process that died or raised ends the job).\nFix: see "
        "the other processes' output for the first error."
    )


def processes_differ(procs: tuple, rows: list[tuple[str, list]]) -> ValueError:
    lines = listing(
        [
            (name, ", ".join(f"process {p}: {v!r}" for p, v in zip(procs, values)))
            for name, values in rows
        ]
    )
    return ValueError(
        f"{CALL}: the processes of the mesh called fit with different arguments:\n"
        f"{lines}\nEvery process trains the same model on one global mesh, so it "
        "must pass the same arguments and arrays of the same shapes.\nFix: pass "
        "the same values in every process (process-local rows of a dataset: "
        "jax.make_array_from_process_local_data, see docs/multi_device.md)."
    )


def accumulate_too_large(k: int, batch_size: int, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: accumulate={k} micro-batches of batch_size={batch_size} need "
        f"{k * batch_size} examples per optimizer step, but the data has {n}.\nFix: "
        f"use accumulate <= {n // batch_size}, or a smaller batch_size."
    )


def steps_and_epochs(steps: Any, epochs: Any) -> TypeError:
    return TypeError(
        f"{CALL}: steps={steps!r} and epochs={epochs!r} are both given.\nFix: "
        "pass one: epochs=E trains exactly E * (n // batch_size) steps."
    )


def epochs_need_arrays(epochs: Any, data: Any) -> TypeError:
    if isinstance(data, list):  # (its length is known, but fit takes it once)
        return TypeError(
            f"{CALL}: epochs={epochs} needs array data with batch_size= (an epoch "
            f"is one pass over its examples); a list of {len(data)} batches is "
            "taken once, in order.\nFix: pass steps=len(batches) for one pass, or "
            "stack the batches into arrays (e.g. jnp.concatenate) and pass them "
            "with batch_size= for epochs of shuffled batches."
        )
    return TypeError(
        f"{CALL}: epochs={epochs} needs array data with batch_size= (an epoch "
        "is one pass over its examples); this data's length is not known.\nFix: "
        "pass steps= (an iterable ends training early when it runs out)."
    )


def epochs_accumulate(epochs: int, per_epoch: int, k: int) -> ValueError:
    return ValueError(
        f"{CALL}: epochs={epochs} is {epochs * per_epoch} batches, which "
        f"accumulate={k} does not divide into whole optimizer steps.\nFix: pass "
        f"steps= instead, or an epochs count that makes a multiple of {k} batches."
    )


def dropout_in_eval_mode(paths: list[str]) -> str:
    listed = ", ".join(f"model{p}" if p.startswith((".", "[")) else p for p in paths)
    return (
        f"{CALL}: the model's Dropout ({listed}) is in eval mode "
        "(deterministic=True), so fit trains it without dropout: fit trains an "
        "NNX model in the mode it finds it in, as a Python loop does (a model.eval() "
        "before fit, for a validation by hand, leaves it there).\nFix: call "
        "model.train() before fit. To train without dropout on purpose, give it "
        "rate=0."
    )


def optimizer_for_another_model(found: str) -> TypeError:
    return TypeError(
        f"{CALL}: the optimizer's state does not fit the model it trains: {found}. "
        "It was made for another model, or the model changed (a layer replaced) "
        "after the optimizer was made.\nFix: make the optimizer for this model: "
        "optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)."
    )


def under_transformation(call: str) -> TypeError:
    return TypeError(
        f"{call}: cannot run inside jax.jit, jax.vmap, jax.grad or another JAX "
        "transformation: it compiles and runs its own programs and returns its "
        "results on the host.\nFix: call it at the top level, outside the "
        "transformed function. To train inside your own jitted function, write "
        "the step yourself and loop it with scanax.scan over (model, optimizer); "
        "to evaluate there, call your eval function on the data."
    )


def under_disable_jit() -> ValueError:
    return ValueError(
        f"{CALL}: cannot run under jax.disable_jit(): fit compiles its training "
        "loop before it runs (and JAX's ahead-of-time path refuses that "
        "setting; a data iterator that yields inside a disable_jit() block "
        "turns it on while fit runs).\nFix: call fit outside the disable_jit() "
        "block. To step through your loss in Python, call loss_fn(model, batch), or "
        "jax.grad of it, under disable_jit(); to see values while fit trains, "
        "print them inside loss_fn with jax.debug.print."
    )


def on_explicit_mesh(name: str, axes: tuple, population: bool) -> ValueError:
    if population:
        fix = (
            "pass fit a mesh= with a 'members' axis (fit then splits the members "
            "over it), or make the members on one device (call scanax.population "
            "outside jax.set_mesh, and put nothing on that mesh in `make`)."
        )
    else:
        fix = (
            "pass mesh=<that mesh> (fit then places the training state and splits "
            "the batches over it), or put its arrays on one device first (e.g. "
            "jax.device_put(params, jax.devices()[0]))."
        )
    return ValueError(
        f"{CALL}: {name} is placed on a mesh with Explicit axes {axes} "
        f"(jax.make_mesh's default), but fit got no mesh=.\nFix: {fix}"
    )


def steps_missing() -> TypeError:
    return TypeError(
        f"{CALL}: how long to train is missing.\nFix: pass steps=N (optimizer "
        "steps to add) or, for array data, epochs=E."
    )


def ema_type(ema: Any) -> TypeError:
    return TypeError(
        "scanax.Ema: its decay (fit's `ema` shorthand) must be a decay (a float "
        f"in [0, 1)), got {short_type(ema)}.\nFix: pass e.g. scanax.Ema(0.999)."
    )


def ema_on_eval_type(value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `on_eval` of scanax.Ema (fit's `ema_eval=`) must be True or "
        f"False, got {short_type(value)}.\nFix: pass on_eval=True to evaluate "
        "with the average, or leave it out."
    )


def ema_value(ema: Any) -> ValueError:
    return ValueError(
        f"scanax.Ema: the decay {ema!r} (ema={ema!r}) is not in [0, 1): the "
        "average is e = decay * e + (1 - decay) * p after each step.\nFix: pass "
        "a decay such as scanax.Ema(0.99) or scanax.Ema(0.999)."
    )


def ema_option_without_ema(name: str) -> TypeError:
    return TypeError(
        f"{CALL}: `{name}` is given without `ema`.\nFix: pass ema=decay (e.g. "
        "0.999) too, or drop it."
    )


def ema_state_mismatch() -> TypeError:
    return TypeError(
        f"{CALL}: `ema_state` (scanax.Ema's `state`) is not a model of this "
        "model's structure (its trained parameters differ in structure, shape or "
        "dtype).\nFix: pass the `result.ema` of an earlier fit of this model."
    )


def iterator_state_type(state: Any) -> TypeError:
    return TypeError(
        f"{CALL}: the data iterator's state (from get_state() or state_dict()) "
        f"is {short_type(state)}, which a checkpoint cannot hold: it must be "
        "bytes or what `json` writes and reads back equal (dicts, lists, "
        "strings, numbers).\nFix: return such a state, or pass an iterator "
        "without get_state/set_state (it is then skipped forward on resume)."
    )


def precision_value(precision: Any, call: str = CALL) -> ValueError:
    if call != CALL:  # scanax.Precision(dtype)
        return ValueError(
            f"{call}: dtype={precision!r} is not one it knows: expected 'bfloat16' "
            "or 'float16'.\nFix: pass scanax.Precision('bfloat16') (compute in "
            "bfloat16, float32 parameters and optimizer state) or "
            "scanax.Precision('float16') (the same in float16, with dynamic loss "
            "scaling); for float32 leave scanax.Precision out."
        )
    return ValueError(
        f"{CALL}: precision={precision!r} is not one fit knows: expected "
        "'bfloat16', 'float16' (scanax.Precision's dtype) or None (no "
        "scanax.Precision).\nFix: pass scanax.Precision('bfloat16') (compute in "
        "bfloat16, float32 parameters and optimizer state) or "
        "scanax.Precision('float16') (the same in float16, with dynamic loss "
        "scaling); for float32 give no Precision (precision=None)."
    )


def metric_name_owned(fn: str, name: str) -> ValueError:
    return ValueError(
        f"{CALL}: {fn} returns a metric named {name!r}, the name under which "
        f"fit(epochs=...) records each step's {name} in the history.\n"
        f"Fix: rename that metric, e.g. {name!r} -> 'my_{name}'."
    )


def loss_scale_metric_taken(name: str) -> ValueError:
    return ValueError(
        f"{CALL}: loss_fn returns a metric named {name!r}, the name under which "
        "precision='float16' records each step's loss scale in the history.\n"
        "Fix: rename that metric."
    )


def loss_scale_state_without_float16(precision: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_scale_state` (scanax.Precision's `state`) continues "
        f"float16's dynamic loss scale, but precision={precision!r}.\nFix: pass "
        "precision='float16' (as in the call whose `result.loss_scale` this is), "
        "or drop the state."
    )


def loss_scale_state_type(state: Any, want: str) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_scale_state` (scanax.Precision's `state`) must be the "
        f"`result.loss_scale` of an earlier fit with precision='float16' ({want}), "
        f"got {short_type(state)}.\nFix: pass `state=result.loss_scale` of the "
        "previous call to continue its scale and count of good steps."
    )


def loss_scale_state_field(name: str, value: Any, want: str) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_scale_state.{name}` (scanax.Precision's `state`) must be "
        f"{want}, got {short_type(value)}.\nFix: pass scanax.Precision(..., "
        "state=result.loss_scale) (loss_scale_state=) "
        "of an earlier call (of the same model, or population of as many "
        "members), or change only its values with `._replace(...)`."
    )


def loss_scale_state_value(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(
        f"{CALL}: `loss_scale_state.{name}` (scanax.Precision's `state`) must be "
        f"{rule}, got {value!r}.\nFix: pass scanax.Precision(..., state="
        "result.loss_scale) (loss_scale_state=) of an earlier call, or "
        "a scale between 1 and 2**15 and a count of good steps >= 0."
    )


def best_dir_without_stop() -> TypeError:
    return TypeError(
        f"{CALL}: best_dir= keeps the best model by a monitored metric, and "
        "none is given.\nFix: pass scanax.EarlyStop(monitor, patience=..., "
        "best_dir=...) in callbacks instead (patience=None: never stop, only keep "
        "the best), with scanax.Eval(..., every=N)."
    )


def best_dir_is_checkpoint_dir(path: Any) -> ValueError:
    return ValueError(
        f"{CALL}: best_dir and checkpoint_dir are the same directory ({path!r}); "
        "each keeps its own checkpoints.\nFix: give best_dir its own directory "
        "(e.g. a subdirectory 'best' of checkpoint_dir)."
    )


def callbacks_type(given: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `callbacks` must be a list of features, got "
        f"{short_type(given)}.\nFix: pass a list, e.g. callbacks=[scanax.Eval("
        "(x_val, y_val), every=100), scanax.EarlyStop('val_loss', patience=3)]."
    )


# Keywords of Keras's `model.fit` and Lightning's `Trainer`, and fit's own for
# what they do (checked before close spellings: `validation_data` is close to
# `eval_data`, the old shorthand, where scanax.Eval is the answer).
_PEERS = {
    "shuffle": "key=jax.random.key(seed) (shuffles each epoch; key=None: in order)",
    "verbose": "progress=False (no bar) or progress=True",
    "validation_data": "callbacks=[scanax.Eval((x_val, y_val), every=N)]",
    "validation_split": "callbacks=[scanax.Eval((x_val, y_val), every=N)] with "
    "data you split off yourself",
    "validation_freq": "scanax.Eval(..., every=N) (N in steps)",
    "max_steps": "steps=N",
    "max_epochs": "epochs=N",
    "steps_per_execution": "steps_per_call=N",
    "initial_epoch": "nothing: a later call continues from the optimizer's step",
    "accumulate_grad_batches": "accumulate=N",
}


def unexpected_keyword(name: str, known: list[str]) -> TypeError:
    if name in _PEERS:
        hint = f" In scanax.fit that is {_PEERS[name]}."
    else:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean `{close[0]}`?" if close else ""
    return TypeError(
        f"{CALL}() got an unexpected keyword argument {name!r}.{hint}\nFix: "
        "pass one of fit's keywords (see help(scanax.fit)), or a feature object "
        "in callbacks=[...]."
    )


def keyword_and_object(name: str, kind: str) -> TypeError:
    return TypeError(
        f"{CALL}: `{name}=` and a scanax.{kind} in callbacks= both describe "
        f"scanax.{kind}.\nFix: give it once: the object in callbacks= (the "
        f"keyword is shorthand for it), e.g. drop `{name}=`."
    )


def callback_unknown(index: int, entry: Any, kinds: list[str]) -> TypeError:
    hint = ""
    if callable(entry) and not isinstance(entry, type):
        hint = " A function as a log sink goes in scanax.Log(fn, every=10)."
    return TypeError(
        f"{CALL}: callbacks[{index}] is {short_type(entry)}, which is not a "
        f"feature of fit.{hint}\nFix: pass objects of "
        f"{', '.join('scanax.' + k for k in kinds)}."
    )


def callback_twice(kind: str) -> ValueError:
    return ValueError(
        f"{CALL}: callbacks= holds two scanax.{kind} objects; a run has one.\n"
        "Fix: keep one of them."
    )


def replay_differs(t: int, done: int) -> str:
    """A call from step ``t`` (0-based) hit a non-finite step, and replaying
    its steps to find which did not reproduce its run."""
    return (
        f"{CALL}: a step of the call from step {t + 1} gave a non-finite loss, "
        "gradients or parameters, and replaying that call's steps to find which "
        "did not reproduce its run: its steps are not deterministic (a host "
        "callback, randomness not drawn from fit's key, or a nondeterministic "
        f"reduction on a GPU). Training stopped at that call's start: the result "
        f"holds the state after step {t} ({done} good steps in this call)."
    )


def sinks_share_a_path(first: str, second: str, path: Any) -> ValueError:
    return ValueError(
        f"{CALL}: callbacks= holds a scanax.{first} and a scanax.{second} writing "
        f"to the same path {str(path)!r}: their rows would be interleaved and "
        "overwritten.\nFix: give each sink its own path (one sink per file or "
        "directory)."
    )


def save_after_error_failed(step: int, err: BaseException) -> str:
    cause = f"{type(err).__name__}: {err}".split("\n", 1)[0][:300]
    return (
        f"{CALL}: saving the last checked state (step {step}) after this error "
        f"failed too: {cause}. The checkpoints before it are kept."
    )


def interrupted_nnx(
    done: int,
    start: int,
    end: int,
    rewound: bool = False,
    ahead: int = 0,
    restored: int | None = None,
    how: str = "interrupted",
) -> str:
    at = done if restored is None else restored  # (where the data stands)
    read = _read_ahead(at, rewound, ahead)
    if restored is not None and restored != done:
        return (
            f"{CALL}: {how}; the NNX model and optimizer hold step {done}, as "
            f"given: checkpoint {restored} was restored, but no call of it was "
            f"read. The same fit(..., steps={end - start}) again resumes from "
            f"checkpoint {restored} and ends at step {end}." + read
        )
    return (
        f"{CALL}: {how}; the NNX model and optimizer hold step {done} (the "
        f"last checked call; this call went from step {start} to {end}). Calling "
        f"the same fit(..., steps={end - start}) again trains that many more steps "
        f"from step {done}; to end this run at step {end}, pass steps={end - done}."
        + read
    )


def _read_ahead(at: int, rewound: bool, ahead: int) -> str:
    """What became of the data iterator's batches past step ``at``."""
    if rewound:
        return (
            f" The data iterator (resumable) was set back to step {at}: given "
            "again, it goes on from there."
        )
    if ahead:
        return (
            f" The data iterator had given {ahead} batch(es) past step {at} "
            "(read ahead for the next call): they were not trained."
        )
    return ""


def fit_result_attached(
    steps: int, nnx: bool, name: str, rewound: bool, ahead: int, at: int
) -> str:
    if nnx:
        return (
            f"{CALL}: the result of the state the NNX objects hold, with its "
            f"history, is this exception's `fit_result`: `except {name} as e: "
            "result = e.fit_result` (in a notebook, `sys.last_value.fit_result`)."
        )
    return (
        f"{CALL}: the result of the last checked state (step {at}; {steps} "
        "step(s) beyond the model passed in), as new objects, with its history, is "
        f"this exception's `fit_result`: `except {name} as e: result = "
        "e.fit_result` (in a notebook, `sys.last_value.fit_result`); it is the "
        "last state, not an EarlyStop's best. To continue, pass its model to "
        "fit again (with an optax transform, also `opt_state=result.optimizer`)."
        + _read_ahead(at, rewound, ahead)
    )


def loss_fn_reads_the_model(name: str) -> str:
    return (
        f"{CALL}: `loss_fn` reads the model being trained as `{name}` from outside "
        "(its closure or globals), not as its first argument. fit differentiates "
        f"the model it passes in: if the loss calls `{name}`, its gradients are "
        f"zero and the loss never moves.\nFix: use the argument, def loss_fn("
        f"model, batch): ... model(x) ... (not `{name}`); reading a static "
        "attribute of it is harmless."
    )


def loss_fn_wrote_the_model(name: str) -> TypeError:
    return TypeError(
        f"{CALL}: `loss_fn` reads the model being trained as `{name}` from outside "
        "(its closure or globals), not as its first argument, and calling it "
        "changed its state (BatchNorm statistics) from inside fit's compiled "
        "step, which NNX refuses.\nFix: use the argument, def loss_fn(model, "
        f"batch): ... model(x) ... (not `{name}`)."
    )
