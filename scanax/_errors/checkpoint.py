"""Messages of ``scanax.fit``'s checkpoints: reading, resuming and refusing."""

from __future__ import annotations

from typing import Any

from . import short_type
from .fit import CALL

_CHECKPOINT_FIX = (
    "Fix: pass the model (and optimizer, data layout) that wrote it, or another "
    "checkpoint_dir (or delete this one to start over)."
)


def no_orbax(option: str = "checkpoint_dir") -> ImportError:
    return ImportError(
        f"{CALL}: {option} needs orbax-checkpoint, which is not "
        "installed.\nFix: `pip install orbax-checkpoint` (or "
        f"`scanax[checkpoint]`), or pass {option}=None."
    )


def checkpoint_at(step: int, directory: Any, call: str = CALL, best: bool = False):
    """How a message names a checkpoint: ``scanax.fit: the checkpoint at step
    40 in DIR``, or ``scanax.load_best: the best state (step 15) in DIR``."""
    what = f"the best state (step {step})" if best else f"the checkpoint at step {step}"
    return f"{call}: {what} in {directory}"


def not_a_best_dir(path: str) -> ValueError:
    return ValueError(
        f"scanax.load_best: {path!r} holds scanax.Checkpoint's checkpoints, not a "
        "best state.\nFix: pass EarlyStop's best_dir (load_best reads the best "
        "state only); a Checkpoint directory is read by calling fit again with "
        "it, which resumes from its newest checkpoint."
    )


def checkpoint_format(at: str, found: Any, expected: int) -> ValueError:
    return ValueError(
        f"{at} has format {found!r}, expected {expected}.\n{_CHECKPOINT_FIX}"
    )


def checkpoint_mismatch(at: str, name: str, found: str, expected: str) -> ValueError:
    return ValueError(
        f"{at} does not fit this training state; "
        f"first mismatching leaf {name}:\n  checkpoint  {found}\n  expected    "
        f"{expected}\n{_CHECKPOINT_FIX}"
    )


def checkpoint_leaves_differ(
    at: str, only_saved: list[str], only_here: list[str]
) -> ValueError:
    def shown(names):
        return (
            ", ".join(names[:5])
            + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            if names
            else "none"
        )

    saved, here = _callbacks(only_saved), _callbacks(only_here)
    fix = _CHECKPOINT_FIX
    if saved or here:  # (a training feature's state: the callbacks differ)
        parts = [f"written with {', '.join(saved)}"] if saved else []
        parts += [f"this run adds {', '.join(here)}"] if here else []
        fix = (
            f"The run's callbacks differ from those that wrote it ({'; '.join(parts)}"
            ").\nFix: resume with the callbacks the checkpoint was written with, "
            "or another checkpoint_dir (or delete this one to start over)."
        )
    return ValueError(
        f"{at} does not fit this training state: it "
        f"holds other arrays.\n  only in the checkpoint  {shown(only_saved)}\n  "
        f"only in this run        {shown(only_here)}\n{fix}"
    )


# The checkpoint names of a training feature's state (their first part), and
# the callback that keeps it.
_FEATURES = {
    "ema": "scanax.Ema",
    "plateau": "scanax.Plateau",
    "stop": "scanax.EarlyStop",
    "loss_scale": "a loss scale (scanax.Precision('float16') or scanax.LossScale)",
    "rollout": "scanax.Rollout",
}


def _callbacks(names: list[str]) -> list[str]:
    """The callbacks whose state ``names`` hold, in order, once each."""
    found = (_FEATURES.get(n.partition(".")[0].partition("[")[0]) for n in names)
    return list(dict.fromkeys(f for f in found if f is not None))


def checkpoint_other_data(at: str, found: Any, data: Any) -> ValueError:
    if (
        isinstance(found, dict)
        and isinstance(data, dict)
        and found.get("hyperparameters") != data.get("hyperparameters")
    ):
        return ValueError(
            f"{at} was written for other hyperparameters: "
            f"{found.get('hyperparameters')}, now {data.get('hyperparameters')}; "
            "a resumed sweep would continue other members.\nFix: pass the "
            "population's own values to resume it, or another checkpoint "
            "directory for a new sweep."
        )
    return ValueError(
        f"{at} was written for other data: "
        f"{short_type(found)} {found}, now {data}; a resumed run would not repeat "
        f"the same batches.\n{_CHECKPOINT_FIX}"
    )


def restored_type(step: int, name: str, restored: Any, expected: Any) -> TypeError:
    return TypeError(
        f"{CALL}: checkpoint step {step} gave back {name} as {short_type(restored)}, "
        f"expected {short_type(expected)}.\nFix: resume with the model and optimizer "
        "that wrote the checkpoint, or use a new checkpoint_dir."
    )


def checkpoint_unreadable(
    step: int, directory: Any, err: Exception, last: bool = False, start: int = 0
) -> str:
    then = (
        f"no readable checkpoint is left in it, so training starts from step "
        f"{start}, the model as given (nothing is resumed)."
        if last
        else "falling back to an older one."
    )
    return (
        f"{CALL}: checkpoint {step} in {directory} could not be read "
        f"({type(err).__name__}: {str(err)[:200]}); {then}"
    )


def checkpoint_past_end(
    directory: Any, found: list[int], start: int, end: int
) -> ValueError:
    return ValueError(
        f"{CALL}: checkpoint_dir {directory} holds step(s) "
        f"{', '.join(map(str, found))}, past this call's end: the model is at "
        f"step {start} and steps={end - start} ends at step {end}. The directory "
        "was written by a longer run, so nothing here can be resumed.\nFix: ask "
        f"for steps={found[0] - start} (or more) to continue from step {found[0]}, "
        "or pass another checkpoint_dir to start afresh."
    )


def checkpoint_key_differs(at: str, saved: str, given: str):
    return ValueError(
        f"{at} was written with a "
        f"key of type {saved}; this call's key is {given}, another PRNG "
        "implementation. A resume continues the saved key (its shuffle and "
        "per-step keys), which this call's program cannot take.\nFix: pass a key "
        "of the saved implementation (jax.random.key(seed, impl=...)), or another "
        "checkpoint_dir to start afresh."
    )


def checkpoint_stopped(directory: Any, step: int) -> str:
    return (
        f"{CALL}: the checkpoint directory {directory} holds this call's early "
        f"stop at step {step}: its state was restored and there was nothing left "
        "to train."
    )


def checkpoint_at_end(directory: Any, end: int) -> str:
    return (
        f"{CALL}: the checkpoint directory {directory} already holds step {end}, "
        "this call's end: its state was restored and there was nothing left to "
        "train."
    )


def checkpoint_other_key(directory: Any, step: int) -> str:
    return (
        f"{CALL}: resumed from step {step} in {directory}, a run given another "
        "key=: its data order and randomness go on from the saved key, not from "
        "the one given. If this is another experiment (a new seed, learning rate "
        "or data), give it its own checkpoint directory: a directory resumes "
        "whatever run of the same shapes saved there."
    )


def later_checkpoints_kept(directory: Any, later: list[int], end: int) -> str:
    return (
        f"{CALL}: the checkpoint directory {directory} also holds later step(s) "
        f"{', '.join(map(str, later))} of a longer run. This call's checkpoints "
        f"(up to step {end}) are written beside them, replacing any at the same "
        "steps; the later ones are kept, and a call that reaches them resumes "
        "from them. Use another directory to keep the runs apart."
    )


def no_best_state(path: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"scanax.load_best: no best state saved in {path!r}.\nFix: pass the "
        "best_dir of a fit that evaluated at least once (its stop= monitor "
        "improved at least once)."
    )


_LOAD_BEST = "scanax.load_best"


def best_member_needed(path: str, n: int) -> TypeError:
    return TypeError(
        f"{_LOAD_BEST}: {path!r} holds the best states of a population of {n} "
        "members, and no member= was given.\nFix: pass member=i (0 <= i < "
        f"{n}) with a model and optimizer of one member's structure (what "
        "make(key, ...) returns)."
    )


def best_not_population(path: str, member: Any) -> TypeError:
    return TypeError(
        f"{_LOAD_BEST}: member={member!r} was given, but {path!r} holds one "
        "model's best state (a fit of one model, not of a population).\nFix: "
        "drop member=."
    )


def best_member_index(member: Any, index: int | None, n: int) -> Exception:
    """``index``: ``member`` as an int when it is one, out of range."""
    if index is not None:
        return IndexError(
            f"{_LOAD_BEST}: member={index} of a population of {n}.\nFix: pass "
            f"member=i with -{n} <= i < {n}."
        )
    return TypeError(
        f"{_LOAD_BEST}: member= takes an int, got {short_type(member)}.\nFix: "
        "pass the member's index, member=i."
    )


def best_member_none(path: str, member: int) -> FileNotFoundError:
    return FileNotFoundError(
        f"{_LOAD_BEST}: member {member} has no best state in {path!r}: its "
        "stop= monitor never improved (no evaluation, or none finite).\nFix: "
        "pick another member (result.best_step[i] >= 0), or train longer."
    )


def save_failed(
    directory: Any, step: int, err: BaseException, newest: Any, best: bool = False
) -> OSError:
    """An ``OSError`` of the cause's class where it is one (PermissionError,
    a full disk's OSError), naming what is kept."""
    what = "the best state" if best else f"checkpoint {step}"
    if newest is None:
        kept = "No complete checkpoint was there before it"
    elif best:
        kept = "The previous best state stays complete and loadable"
    else:
        kept = (
            f"The checkpoints before it are complete: the newest, step {newest}, "
            "is where the same call resumes"
        )
    cause = f"{type(err).__name__}: {err}".split("\n", 1)[0][:500]
    message = (
        f"{CALL}: saving {what} in {directory} failed: {cause}\n{kept}.\nFix: make "
        "the directory writable (or free space on its disk), then run the same "
        "call again."
    )
    cls = type(err) if isinstance(err, OSError) else OSError
    try:
        return cls(message)
    except TypeError:  # (a subclass with other arguments)
        return OSError(message)


def remote_dir(path: str, what: str = "checkpoint_dir", call: str = CALL) -> ValueError:
    return ValueError(
        f"{call}: {what} {path!r} is a URL; scanax writes checkpoints to local "
        "directories only (the index beside them and its checks use Python's os)."
        "\nFix: pass a local directory (copy it to the bucket afterwards), or a "
        "mounted bucket's path (gcsfuse, s3fs)."
    )
