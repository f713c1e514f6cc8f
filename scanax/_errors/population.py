"""Messages of ``scanax.population`` and of ``scanax.fit`` on a population."""

from __future__ import annotations

from typing import Any

from . import short_type
from .fit import CALL as FIT

CALL = "scanax.population"


def make_not_callable(make: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `make` must be callable as make(key, **hyperparameters) -> "
        f"(model, optimizer), got {short_type(make)}.\nFix: pass the function that "
        "builds one member first: scanax.population(make, n, key=..., lr=...)."
    )


def n_type(n: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `n` (the number of members) must be a positive int, got "
        f"{short_type(n)}.\nFix: pass e.g. scanax.population(make, 64, key=...)."
    )


def key_type(key: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `key` must be one jax.random key (jax.random.key(0)), got "
        f"{short_type(key)}.\nFix: pass key=jax.random.key(seed); member i is built "
        "with jax.random.split(key, n)[i]."
    )


def hp_type(name: str, value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: hyperparameter `{name}` must be numbers (an array of length n), "
        f"got {short_type(value)}.\nFix: pass one number per member, e.g. "
        f"{name}=jnp.logspace(-4, -2, n); choices that change the model's structure "
        "(layer sizes, activations) belong in separate populations."
    )


def hp_length(name: str, shape: tuple, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: hyperparameter `{name}` has shape {shape}, expected ({n},): one "
        f"value per member.\nFix: pass an array of length {n} (or one number, the "
        "same for every member)."
    )


def hp_used_as_python_value(names: list[str], err: Exception) -> ValueError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ValueError(
        f"{CALL}: a traced value is used as a Python value (an `if`, a shape, "
        "int(...) or float(...)) while tracing the members' step: most likely "
        f"`make` uses a hyperparameter ({', '.join(names)}) as a Python value, or "
        "`loss_fn` an array of the batch. `make` is traced once for all members, "
        "with each hyperparameter a JAX scalar, so one compiled loop serves every "
        f"value.\nJAX said: {first}\nFix: use hyperparameters only as numbers "
        "(optax.adam(lr), a loss weight), and jnp.where instead of an `if` on "
        "data; for a choice that changes shapes or code, build one population "
        "per choice."
    )


def structure_depends_on_hp(kind: str, names: list[str]) -> ValueError:
    return ValueError(
        f"{FIT}: the {kind} state that `make` builds inside the compiled loop "
        f"(with the hyperparameters {', '.join(names)} traced) differs from the "
        "population's.\nFix: `make` must build the same structure for every "
        "hyperparameter value."
    )


def make_arguments(names: list[str], signature: str, err: str) -> TypeError:
    given = ", ".join(f"{k}=..." for k in names)
    called = f"make(key, {given})" if names else "make(key)"
    return TypeError(
        f"{CALL}: `make{signature}` cannot be called as {called} (one keyword "
        f"per hyperparameter given to population): {err}.\nFix: name make's "
        "parameters after the hyperparameters, as in def make(key, lr) with "
        "scanax.population(make, n, key=key, lr=...), or pass the "
        "hyperparameters it takes."
    )


def make_result(out: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `make` must return a (model, optimizer) pair that scanax.fit "
        f"accepts, got {short_type(out)}.\nFix: return e.g. (model, nnx.Optimizer("
        "model, optax.adam(lr), wrt=nnx.Param)), (eqx_model, optax.adam(lr)) or "
        "(train_state, None)."
    )


def make_returned_outer_model(part: str) -> ValueError:
    what = (
        "an NNX model made outside it"
        if part == "model"
        else f"an NNX model whose {part} was made outside it"
    )
    return ValueError(
        f"{CALL}: `make` returned {what} (a pretrained model it closes over?). "
        "NNX models are changed in place, so every member would share that one "
        "object, each overwriting the others' weights (and yours).\nFix: use a "
        "copy per member, e.g. nnx.clone(pretrained), and build the optimizer "
        "on the model make returns."
    )


def optimizer_with_population(optimizer: Any) -> TypeError:
    return TypeError(
        f"{FIT}: a population carries its own optimizers (built by `make`), got "
        f"optimizer={short_type(optimizer)}.\nFix: call scanax.fit(pop, None, "
        "loss_fn, data, ...)."
    )


def opt_state_with_population() -> TypeError:
    return TypeError(
        f"{FIT}: opt_state= is not used with a population: each member's optimizer "
        "state is part of the population and continues across calls.\nFix: drop "
        "opt_state=."
    )


def members_per_call_too_large(k: int, n: int) -> ValueError:
    return ValueError(
        f"{FIT}: members_per_call={k} is larger than the population ({n} members)."
        f"\nFix: pass at most {n}, or drop it (all at once)."
    )


def option_without_population(name: str) -> TypeError:
    return TypeError(
        f"{FIT}: `{name}` is for populations (scanax.population(...)); this model is "
        f"a single one.\nFix: drop {name}=, or train a population."
    )


def shared_batches_iterable() -> TypeError:
    return TypeError(
        f"{FIT}: iterable data is always shared by all members (each batch is "
        "drawn once); shared_batches=False needs array data.\nFix: drop "
        "shared_batches=False, or pass arrays with batch_size=."
    )


def shared_batches_rollout() -> TypeError:
    return TypeError(
        f"{FIT}: with data=scanax.Rollout(...), each member collects its own "
        "batches with its own model (its own carry, from its own key); "
        "shared_batches=True has no meaning.\nFix: drop shared_batches."
    )


def every_member_stopped(n: int) -> str:
    return (
        f"{FIT}: every member of this population ({n}) stopped at a non-finite "
        "loss or gradient in an earlier call (`pop.stopped`), so this call trains "
        "none: its history is empty.\nFix: make a new population (with a smaller "
        "learning rate, say) to train on."
    )


def nonfinite_members(
    members: list[int],
    steps: list[int],
    n: int,
    training: int | None = None,
    group: list[int] | None = None,
    held: list[int] | None = None,
) -> str:
    shown = ", ".join(f"{m} (step {s})" for m, s in list(zip(members, steps))[:10])
    more = f" and {len(members) - 10} more" if len(members) > 10 else ""
    if training != 0:
        others = "the other members train on"
    elif group is not None:  # (members_per_call: a group of the population)
        others = (
            f"no member of this group ({', '.join(map(str, group))}) is left "
            "training, so its call ends here; the other groups train as planned"
        )
    else:
        others = "no member is left training, so the call ends here"
    out = (
        f"{FIT}: {len(members)} of {n} members stopped at a non-finite loss or "
        f"gradient: member {shown}{more}. Each keeps its last good state (its "
        f"history is NaN from there); {others}. See `pop.stopped`."
    )
    if held:
        out += (
            f" But member(s) {held} hold parameters that are not all finite: "
            "the update of their last good step made them so (finite gradients, "
            "an update too large), and only the next loss showed it, so the "
            "state before it is not kept.\nFix: "
            "restore an earlier checkpoint (scanax.Checkpoint) and train with a "
            "smaller learning rate or clipped updates (optax.clip_by_global_norm)."
        )
    return out


def mesh_axis(mesh: Any) -> ValueError:
    return ValueError(
        f"{FIT}: a population on a mesh needs a `members` axis (population "
        f"parallelism), and optionally a `data` axis; got axes {mesh.axis_names}."
        "\nFix: jax.make_mesh((4,), ('members',)) or jax.make_mesh((2, 2), "
        "('members', 'data'))."
    )


def members_not_divisible(k: int, size: int) -> ValueError:
    return ValueError(
        f"{FIT}: {k} members per call do not divide over the mesh's `members` axis "
        f"of size {size}.\nFix: use a population size (or members_per_call) that "
        f"is a multiple of {size}."
    )


def best_not_population() -> TypeError:
    return TypeError(
        f"{FIT}: result.best() ranks the members of a population; this result is "
        "of a single model.\nFix: read result.history directly."
    )


def best_metric(name: str, available: list[str]) -> ValueError:
    return ValueError(
        f"{FIT}: result.best({name!r}): not a scalar metric of the history; "
        f"available: {', '.join(available)}.\nFix: pass one of those names (a "
        "metric with one number per member and step)."
    )


def best_mode(mode: Any) -> ValueError:
    return ValueError(
        f"{FIT}: result.best(mode={mode!r}): expected 'auto', 'min' or 'max'.\n"
        "Fix: mode='max' for metrics where larger is better (accuracy), 'auto' "
        "to choose by the metric's name as EarlyStop does."
    )


def members_per_call_iterable() -> TypeError:
    return TypeError(
        f"{FIT}: members_per_call runs the members in groups, each over the same "
        "batches, which an iterable cannot give twice.\nFix: pass array data "
        "(with batch_size=), or drop members_per_call."
    )


def member_index(i: Any, index: int | None, n: int) -> Exception:
    """``index``: ``i`` as an int when it is one, out of range."""
    if index is not None:
        return IndexError(
            f"{CALL}: member {index} of a population of {n} is out of range (valid: "
            f"{-n}..{n - 1}).\nFix: index with 0 <= i < {n} (negative counts "
            "from the end); result.best() gives the best member's index."
        )
    return TypeError(
        f"{CALL}: members are indexed by an int, got {short_type(i)}.\nFix: "
        f"index with an int i, 0 <= i < {n} (e.g. result.model[i])."
    )


def hp_in_model_fields(names: list[str], paths: list[str]) -> ValueError:
    return ValueError(
        f"{CALL}: `make` stores a hyperparameter ({', '.join(names)}) in the model: "
        f"model{', model'.join(paths)}. In a solo run it is a Python number (static, "
        "never trained); traced for the population it would be an array, and "
        "trained.\nFix: keep it out of the model and read it in the loss "
        "(loss_fn(model, batch, hp) gets hp['name']), or build one population per "
        "value."
    )


def hp_in_static_field(names: list[str], owner: str) -> ValueError:
    return ValueError(
        f"{CALL}: `make` stores a hyperparameter ({', '.join(names)}) in a static "
        f"field of {owner} (eqx.field(static=True)). Static fields are part of the "
        "model's structure, the same for every member, so a value that differs "
        "per member cannot be one (the traced value would leak into JAX's "
        "caches).\nFix: keep it out of the model and read it in the loss "
        "(loss_fn(model, batch, hp) gets hp['name']), or build one population "
        "per value."
    )


def log_with_groups() -> TypeError:
    return TypeError(
        f"{FIT}: logging (scanax.Log, CSV, TensorBoard or log=) with "
        "members_per_call: the groups run one after another, so one log would go "
        "back in steps.\nFix: drop members_per_call, or log each group yourself "
        "from result.history."
    )


def _gib(b: int) -> str:
    """A byte count as people read it (``1.5 GiB``, ``320 KiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} bytes"


def _members(k: int) -> str:
    return f"{k} member" if k == 1 else f"{k} members"


def _free(free: int, share: float) -> str:
    return f"{_gib(free)} is free (fit uses at most {share:.0%} of it)"


def population_in_groups(
    n: int, k: int, fit: int, need: int, free: int, share: float
) -> str:
    return (
        f"{FIT}: one call of {_members(k)} needs {_gib(need)} beyond the population "
        f"itself and {_free(free, share)}, so the {n} members train {fit} at a time "
        "(the same result as all at once within rounding, in more calls). Pass "
        "members_per_call=k to choose the groups yourself."
    )


def _cannot_split(reason: str | None, fit: int) -> str:
    if reason == "log":
        return (
            "log= cannot follow groups that run one after another: drop log= "
            f"(then fit splits it by itself), or train at most {_members(fit)} per "
            "population."
        )
    return (
        f"pass members_per_call={fit} with a new checkpoint_dir (checkpoints "
        "resume only with the groups they were written with, so fit does not "
        "choose groups itself there; a run this directory holds in groups resumes "
        "with the members_per_call it was saved with)."
    )


def population_too_big(
    n: int, k: int, need: int, free: int, share: float, fit: int, reason: str | None
) -> MemoryError:
    what = (
        f"{FIT}: one call of {k} of the {n} members needs {_gib(need)} beyond the "
        f"population itself, and {_free(free, share)}; checked before running: "
        "nothing has changed."
    )
    if fit < 1:
        return MemoryError(
            f"{what}\nFix: not even the smallest group fits: make the model or "
            "batch_size smaller, or free memory."
        )
    return MemoryError(
        f"{what}\nFix: {_members(fit)} at a time would fit; "
        + _cannot_split(reason, fit)
    )


def checkpoint_groups_differ(
    path: str, found: list[str], whole: bool, k: int, n: int
) -> ValueError:
    if found:
        saved = f"in groups ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
        first = [e for e in found if e.startswith("members_0-")]
        size = int(first[0].rsplit("-", 1)[1]) + 1 if first else None
        fix = f"members_per_call={size}" if size else "the groups it was saved with"
    else:
        saved = "with all members at once"
        fix = "members_per_call=None (all at once)"
    now = "all members at once" if k == n else f"groups of {k} members"
    return ValueError(
        f"{FIT}: checkpoint_dir {path!r} holds a run saved {saved}, and this call "
        f"trains {now}: its checkpoints would be ignored.\nFix: resume with "
        f"{fix}, or use another checkpoint_dir for these groups."
    )
