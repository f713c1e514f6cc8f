"""A checkpointed fit keeping its best on disk, for the subprocess tests of
issue 38 (test_checkpoint.py, test_best.py, test_log.py): the process must exit,
and exit 0, once ``fit`` has returned or raised, with what it saved complete.

``python tests/_save_job.py MODE CKPT_DIR BEST_DIR CSV STEPS``:

* ``slow``: every rename and directory creation takes 20 ms (a loaded machine
  or a slow disk: orbax's asynchronous checkpoint writes are still running
  when the next save comes), the best store's pause between saves off (a best
  saved after every call that has one); ``fit`` runs ``STEPS`` steps, a
  checkpoint and a best at every call of 2 steps. Every orbax save is watched:
  one started while another store's was still in flight is printed as
  ``OVERLAP`` (orbax numbers its operations with one process-wide counter:
  two saves in flight at once can wait for each other's signals for ever,
  which is what made such runs time out after 300 s, or exit with status 1,
  under load). Prints ``RETURNED`` after ``fit`` returns.
* ``fault-ckpt``, ``fault-best``, ``fault-log``: a fit of 4 steps first, then
  that directory (or the CSV file) stops taking writes, as a full disk or a
  permission change would, and ``fit`` runs to ``STEPS``. Prints ``RAISED
  <class>: <message>``, the result's steps when the error carries one, then
  ``END``.
"""

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import scanax
from scanax._fit import hooks as _fit_hooks

X = jr.normal(jr.key(0), (64, 3))
Y = X @ jnp.array([[1.0], [2.0], [-1.0]])
P0 = {"w": jnp.zeros((3, 1))}
TX = optax.sgd(0.01)


def loss_fn(p, batch):
    return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)


def fit(ckpt, best, steps, sink=None):
    """The job's ``fit`` (``ckpt``, ``best`` None: without them, a reference)."""
    return scanax.fit(
        P0, TX, loss_fn, (X, Y), steps=steps, batch_size=16, key=jr.key(1),
        steps_per_call=2, progress=False, checkpoint_dir=ckpt,
        checkpoint_every=None if ckpt is None else 2, eval_data=(X, Y),
        eval_every=2, best_dir=best, log=sink, log_every=2,
        stop=scanax.EarlyStop("val_loss", patience=None, restore_best=False),
    )  # fmt: skip


def run(mode, tmp, steps, timeout=120, popen=False):
    """This job in a subprocess, in ``tmp`` (``ckpt``, ``best``, ``log.csv``):
    its ``CompletedProcess`` (``popen``: the running ``Popen``). A process
    that does not exit within ``timeout`` seconds fails the test."""
    args = [sys.executable, __file__, mode, *dirs(tmp), str(steps)]
    if popen:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def dirs(tmp):
    """``(checkpoint_dir, best_dir, csv path)`` under ``tmp``."""
    tmp = Path(tmp)
    return str(tmp / "ckpt"), str(tmp / "best"), str(tmp / "log.csv")


def saved_steps(directory):
    """The complete checkpoints of ``directory`` (numbered folders), and its
    temporary ones (an unfinished save)."""
    names = os.listdir(directory)
    done = sorted(int(n) for n in names if n.isdigit())
    return done, [n for n in names if "tmp" in n]


def _slowed(fn, seconds):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def _watch_saves():
    """Print ``OVERLAP`` when an orbax save starts while another manager's
    save is in flight (an asynchronous one: until it is waited for)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager
    save, wait = manager.save, manager.wait_until_finished
    flying, lock = set(), threading.Lock()

    def watched_save(self, *args, **kwargs):
        with lock:
            if flying - {id(self)}:
                print("OVERLAP", threading.current_thread().name, flush=True)
            flying.add(id(self))
        try:
            return save(self, *args, **kwargs)
        finally:
            if not self._options.enable_async_checkpointing:
                with lock:
                    flying.discard(id(self))

    def watched_wait(self, *args, **kwargs):
        out = wait(self, *args, **kwargs)
        with lock:
            flying.discard(id(self))
        return out

    manager.save, manager.wait_until_finished = watched_save, watched_wait


def _refused(fn, directory):
    def refuse(path, *args, **kwargs):
        if os.path.abspath(os.fspath(path)).startswith(directory):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return fn(path, *args, **kwargs)

    return refuse


class FullDisk:
    """A file that takes no more bytes."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


def main(mode, ckpt, best, csv, steps):
    if mode == "slow":
        os.rename, os.mkdir = _slowed(os.rename, 0.02), _slowed(os.mkdir, 0.02)
        _fit_hooks.PAUSE = 0.0
        _watch_saves()
        fit(ckpt, best, steps)
        print("RETURNED", flush=True)
        return
    sink = scanax.CSV(csv)
    fit(ckpt, best, 4, sink)
    target = {"fault-ckpt": ckpt, "fault-best": best}.get(mode)
    if target is not None:  # (no new directory there: orbax's saves fail)
        target = os.path.abspath(target)
        os.mkdir, os.rename = _refused(os.mkdir, target), _refused(os.rename, target)
    else:
        write = type(sink).__call__

        def full(self, step, metrics):
            self._file = FullDisk(self._file)
            return write(self, step, metrics)

        type(sink).__call__ = full
    try:
        out = fit(ckpt, best, steps, sink)
        print("NO ERROR", out.steps, flush=True)
    except Exception as err:  # noqa: BLE001 - reported to the test
        print(f"RAISED {type(err).__name__}: {err}", flush=True)
        result = getattr(err, "result", None)
        if result is not None:
            print("RESULT STEPS", result.steps, flush=True)
    jax.effects_barrier()
    print("END", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5], int(sys.argv[5]))
