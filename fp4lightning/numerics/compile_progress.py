"""The lines that say the CPU kernels are compiling, so a long first step is not a silent one.

The fused passes (:mod:`fp4lightning.numerics.cpu_fused`) compile at their first calls: on a small
CPU the first training step and the first evaluation batch spend one to three minutes in
``torch.compile``, with nothing else on the terminal or in the log. So, from whichever way the
model is driven (``fp4lightning train``, Lightning's Trainer with the plugin, Fabric, a plain
``convert_to_fp4`` model, ``fp4lightning eval``):

* the first compile of the process prints :data:`NOTICE`, unless it was said already
  (:func:`claim_notice`: the Trainer's plugin logs it before the first step);
* while compiling goes on, a line every :data:`HEARTBEAT_S` seconds (``FP4LIGHTNING_COMPILE_HEARTBEAT``
  sets another interval; ``0``: none) says for how long. A daemon thread prints them; it starts with
  a compile and ends once a whole interval passes without one (the first validation compiles again,
  and starts it again).

Compiles are seen through Dynamo's start/end callbacks and counted only inside :func:`watching`
(the fused-pass wrapper), so a model the user compiles says nothing here. Only the process of
rank 0 prints (the launcher's ``RANK`` / ``LOCAL_RANK``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["NOTICE", "HEARTBEAT_S", "heartbeat_interval", "claim_notice", "watching"]

#: said once per process, at its first compile
NOTICE = "compiling the CPU kernels (at first use only; a minute or more)"
#: seconds between the lines while compiling goes on
HEARTBEAT_S = 20.0
#: the name of the thread that prints them
THREAD_NAME = "fp4lightning-compile-heartbeat"


def heartbeat_interval() -> float:
    """:data:`HEARTBEAT_S`, or ``FP4LIGHTNING_COMPILE_HEARTBEAT`` (seconds; 0 turns the lines off)."""
    value = os.environ.get("FP4LIGHTNING_COMPILE_HEARTBEAT", "").strip()
    if not value:
        return HEARTBEAT_S
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise ValueError(f"FP4LIGHTNING_COMPILE_HEARTBEAT={value!r} is not a number of seconds") from None


def _rank_zero() -> bool:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            return os.environ[var] == "0"
    return True


def _say(text: str) -> None:
    if _rank_zero():
        print(f"fp4lightning: {text}", file=sys.stderr, flush=True)


class _Progress:
    """Counts the compiles under way (inside :func:`watching`) and runs the heartbeat thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()  # .inside: in a fused pass; .counted: its compile was counted
        self.compiling = 0
        self.last_end = 0.0
        self.thread: threading.Thread | None = None
        self.said = False

    def hook(self) -> None:
        """Register with Dynamo's compile callbacks (nothing where this torch has none), again after
        ``torch._dynamo.reset()``, which clears them."""
        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is not None and self.started not in handler.start_callbacks:
            handler.register_start_callback(self.started)
            handler.register_end_callback(self.ended)

    def started(self, _args: object = None) -> None:
        if not getattr(self.local, "inside", False):
            return
        self.local.counted = True
        with self.lock:
            self.compiling += 1
            if not self.said:
                self.said = True
                _say(NOTICE)
            interval = heartbeat_interval()
            if self.thread is None and interval > 0:
                self.thread = threading.Thread(target=self.beat, args=(interval, time.monotonic()),
                                               name=THREAD_NAME, daemon=True)
                self.thread.start()

    def ended(self, _args: object = None) -> None:
        if not getattr(self.local, "counted", False):
            return
        self.local.counted = False
        with self.lock:
            self.compiling -= 1
            self.last_end = time.monotonic()

    def beat(self, interval: float, since: float) -> None:
        """Every ``interval`` s: a line if a compile is under way; gone after an interval without one."""
        while True:
            time.sleep(interval)
            with self.lock:
                now = time.monotonic()
                if not self.compiling and now - self.last_end >= interval:
                    self.thread = None
                    return
                busy = self.compiling > 0
            if busy:
                _say(f"still compiling the CPU kernels ({now - since:.0f} s so far)")


_PROGRESS = _Progress()


def claim_notice() -> bool:
    """True, once per process, for a caller that says :data:`NOTICE` its own way (the Trainer's plugin
    logs it before the first step); the first compile then does not say it again. False once said."""
    with _PROGRESS.lock:
        claimed, _PROGRESS.said = not _PROGRESS.said, True
    return claimed


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Compiles that start inside the block are announced and timed (see the module docstring)."""
    _PROGRESS.hook()
    local = _PROGRESS.local
    outer = getattr(local, "inside", False)
    local.inside = True
    try:
        yield
    finally:
        local.inside = outer
