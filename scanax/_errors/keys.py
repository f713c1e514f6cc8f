"""Messages of ``_keys``: what a user's function takes after ``(model, batch)``
(``scanax.fit``'s ``loss_fn`` and ``eval_fn``, ``scanax.evaluate``'s
``eval_fn``, ``scanax.predict``'s ``fn``), and a key that an evaluation uses
when none was given."""

from __future__ import annotations

NAMES = ("key", "rng", "rngs")
_RULE = (
    "a parameter named key, rng or rngs (with or without a default), or a "
    "third one without a default, is given the key"
)


def forms(name: str, population: bool) -> str:
    """The call forms of ``name``."""
    if population:
        return (
            f"{name}(model, batch), {name}(model, batch, hp) with a member's "
            f"hyperparameters, {name}(model, batch, key) or {name}(model, batch, "
            "hp, key)"
        )
    return f"{name}(model, batch) or {name}(model, batch, key)"


def _who(call: str) -> str:
    return "fit" if call == "scanax.fit" else call


def too_many(call: str, name: str, names: list[str], population: bool) -> TypeError:
    return TypeError(
        f"{call}: `{name}` takes {len(names)} required positional arguments "
        f"({', '.join(names)}); {_who(call)} calls {forms(name, population)}.\n"
        "Fix: give the other arguments defaults, or bind them with "
        "functools.partial."
    )


def too_few(call: str, name: str, names: list[str], population: bool) -> TypeError:
    got = ", ".join(names) or "none"
    return TypeError(
        f"{call}: `{name}` takes {len(names)} positional argument"
        f"{'' if len(names) == 1 else 's'} ({got}); {_who(call)} calls "
        f"{forms(name, population)}.\nFix: define it as def {name}(model, batch): "
        "... (the batch is a slice of the data along its leading axis)."
    )


def keyword_only(call: str, name: str, param: str) -> TypeError:
    fix = (
        f"define {name}(model, batch, {param}) (without the `*`): the key is "
        "passed as the third positional argument"
        if param in NAMES
        else "give it a default, or bind it with functools.partial"
    )
    return TypeError(
        f"{call}: `{name}` has a required keyword-only parameter `{param}`, which "
        f"{_who(call)} never passes.\nFix: {fix}."
    )


def key_keyword_only(call: str, name: str, param: str) -> TypeError:
    return TypeError(
        f"{call}: `{name}`'s keyword-only parameter `{param}` is named like a "
        f"key, but {_who(call)} passes the key as the third positional argument "
        f"({_RULE}).\nFix: drop the `*`: def {name}(model, batch, {param}=None)."
    )


def key_like(call: str, name: str, param: str) -> TypeError:
    return TypeError(
        f"{call}: `{name}`'s third parameter `{param}` looks like a key, but it "
        f"has a default and another name, so it would never be given one "
        f"({_RULE}).\nFix: rename it `key` (or `rng`, `rngs`) to get a fresh key, "
        f"or bind it if it must keep its default: functools.partial({name}, "
        f"{param}=...)."
    )


def key_used(call: str, name: str, param: str, fit: bool) -> TypeError:
    where = "fit was called with key=None" if fit else "no `key` was given"
    fix = (
        "pass key=jax.random.key(seed) to fit (evaluation j gets keys derived from it)"
        if fit
        else "pass key=jax.random.key(seed) (batch j gets jax.random.fold_in(key, j))"
    )
    return TypeError(
        f"{call}: `{name}` uses its key `{param}` in eval mode (its result "
        f"depends on the key: something draws random numbers even with the model "
        f"in eval mode), but {where}.\nFix: {fix}, or make the evaluation "
        "deterministic."
    )
