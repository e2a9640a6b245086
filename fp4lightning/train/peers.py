"""Which host each rank runs on, and how long a collective may wait: what a run says when a host dies.

At the start of a multi-process fit every rank sends the others its address (the local address it
reaches the master with) and host name (:class:`PeerTable`, one ``all_gather_object``). When a host
dies, its processes' sockets close and gloo's error on the survivors names the peer's address
(``Read error [10.47.0.2]:49792: Connection reset by peer``): :func:`lost_host` maps it back to that
host's ranks. A host that loses power or its link closes nothing; the survivors then wait inside a
collective until the process-group timeout, which ``FP4LIGHTNING_DIST_TIMEOUT`` (seconds) sets
(:func:`process_group_timeout`; Lightning's default is 30 minutes), and :func:`timed_out` recognises
gloo's "Timed out waiting" error, which names no one (docs/distributed.md, "Multi-node").
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta
from typing import Optional

import lightning as L
import torch.distributed as dist

from fp4lightning.errors import UsageError

__all__ = ["TIMEOUT_ENV", "process_group_timeout", "local_address", "PeerTable", "lost_host", "timed_out",
           "tell_lost_host", "heard_lost_host"]

#: seconds a collective may wait before it fails on every rank (unset: Lightning's 30 minutes)
TIMEOUT_ENV = "FP4LIGHTNING_DIST_TIMEOUT"
#: the peer's address in gloo's error for a closed connection
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
#: gloo's error for a collective that waited past the process-group timeout
_TIMED_OUT = "timed out waiting"


def process_group_timeout() -> Optional[timedelta]:
    """The process-group timeout ``FP4LIGHTNING_DIST_TIMEOUT`` asks for; None when it is unset."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"environment variable {TIMEOUT_ENV}={raw!r} is not a positive number of seconds; "
                         f"set e.g. {TIMEOUT_ENV}=60, or unset it for Lightning's 30 minutes")
    return timedelta(seconds=seconds)


def local_address() -> str:
    """The local address this process reaches the master (``MASTER_ADDR``) from; the host name without one."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: nothing is sent
                return s.getsockname()[0]
        except (OSError, ValueError):
            pass
    return socket.gethostname()


class PeerTable(L.Callback):
    """Each rank's ``(address, host name)``, gathered once when the fit starts on several processes."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, str]] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized() and not self.peers:
            peers: list = [None] * trainer.world_size
            dist.all_gather_object(peers, (local_address(), socket.gethostname()))
            self.peers = [tuple(p) for p in peers]


def _chain(exc: BaseException):
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def lost_host(exc: BaseException, peers: list[tuple[str, str]], rank: int) -> Optional[str]:
    """``"ranks 2, 3 (host 10.47.0.2)"`` when ``exc`` (or one it was raised while handling) names the address
    of another host in ``peers`` (rank ``rank``, this process, is on a different one); the host name stands
    for the address where it tells the hosts apart. Else None (an address of this host names no one rank)."""
    own = peers[rank][0] if 0 <= rank < len(peers) else None
    for e in _chain(exc):
        for address in _PEER_ADDRESS.findall(str(e)):
            ranks = [r for r, (a, _) in enumerate(peers) if a == address]
            if not ranks or address == own:
                continue
            names = {n for a, n in peers if a == address}
            name = address
            if len(names) == 1 and all(a == address for a, n in peers if n in names):
                name = names.pop()  # a host name only this address has
            what = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            return f"{what} (host {name})"
    return None


#: the process group's store key under which the first survivor that names a lost host leaves its words
_LOST_KEY = "fp4lightning/lost_host"


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no group, or a torch without it: nothing to share
        return None


def tell_lost_host(description: str) -> None:
    """Leave ``lost_host``'s words in the process group's store for the other survivors: one on the same
    host may see only this rank's socket close when this rank exits (an address of its own host, which
    names no one). Best effort: a store that is gone (its host was the one lost) is skipped."""
    store = _store()
    if store is not None:
        try:
            store.set(_LOST_KEY, description)
        except Exception:  # noqa: BLE001
            pass


def heard_lost_host(wait_s: float = 2.0) -> Optional[str]:
    """The lost host another survivor named (``tell_lost_host``), waiting at most ``wait_s``; else None."""
    store = _store()
    if store is None:
        return None
    try:
        store.wait([_LOST_KEY], timedelta(seconds=wait_s))
        value = store.get(_LOST_KEY)
    except Exception:  # noqa: BLE001 - not set in time, or the store is gone
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or one it was raised while handling) is gloo's error for a collective past its timeout."""
    return any(isinstance(e, RuntimeError) and _TIMED_OUT in str(e).lower() for e in _chain(exc))
