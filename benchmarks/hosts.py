"""Two hosts on one machine: two network namespaces joined by a veth pair with a chosen rate and latency.

Every multi-rank test on loopback sends bytes for free; here a byte costs what the link says. As root,
``TwoHosts`` makes two namespaces (each its own TCP stack and loopback), joins them with a veth pair,
puts an address of a private /30 on each end (10.47.0.1 on host 0, 10.47.0.2 on host 1; the two
namespaces are the only ones that hold them, so nothing outside them is ever contacted), limits each
end's egress with ``tc``: ``tbf`` for the rate, ``netem`` for a one-way delay (the link's round trip is
twice the delay), and runs commands in either host. Leaving the ``with`` block, however it is left
(normal end, an exception, Ctrl-C, SIGTERM, SIGHUP), kills every process it started (their process
groups) and anything else still inside the namespaces (``ip netns pids``), then deletes both namespaces,
which deletes the veth pair with them.

API::

    from hosts import TwoHosts, HostsUnavailable, unavailable_reason

    reason = unavailable_reason()          # None, or one line: why this machine cannot make hosts
    with TwoHosts(rate="1gbit", delay_ms=0) as h:
        h.addr(0), h.addr(1)               # "10.47.0.1", "10.47.0.2"
        h.ifname                           # "veth0" on both hosts (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
        h.ns(0)                            # the namespace's name, unique per process and instance
        p = h.popen(0, ["python", "-c", "..."], env=..., stdout=...)   # subprocess.Popen in host 0,
                                           # its own session (process group), killed at teardown
        r = h.run(1, cmd, timeout=30, capture_output=True, text=True)  # subprocess.run in host 1
        h.kill_host(1)                     # SIGKILL every process inside host 1 (a host that dies)
        h.link_down()                      # or: take the link down (both ends)
        h.pids(0)                          # pids inside host 0 now

``TwoHosts(rate=None)`` leaves the link unlimited; ``delay_ms > 0`` needs ``sch_netem`` in the kernel
(``CONFIG_NET_SCH_NETEM``), and refuses in one line without it. Any failure to build the hosts raises
``HostsUnavailable`` with one line (not root, no ``ip``/``tc``, no netns support, a missing qdisc).
Importable by path (``benchmarks/`` is not a package): ``sys.path.insert(0, "benchmarks"); import hosts``.

CLI (the two commands run at once, one per host; ``{addr0}``, ``{addr1}``, ``{ifname}`` and ``{rank}``
are substituted in each, and ``HOST0_ADDR``, ``HOST1_ADDR``, ``HOST_IFNAME``, ``HOST_RANK`` are set in
their environments; exit status: the first non-zero one of the two, or 0)::

    python benchmarks/hosts.py --check                       # can this machine make the hosts?
    python benchmarks/hosts.py --rate 1gbit --host0 'CMD' --host1 'CMD'
    python benchmarks/hosts.py --cleanup                     # remove namespaces of dead harness processes

A harness killed with SIGKILL cannot tear down; ``--cleanup`` (or ``cleanup_stale()``) removes the
namespaces whose creating process is gone.
"""

import argparse
import atexit
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

PREFIX = "fp4h"
SUBNET = "10.47.0"  # a private /30: .1 on host 0, .2 on host 1
IFNAME = "veth0"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-[01]$")
_counter = itertools.count()


class HostsUnavailable(RuntimeError):
    """This machine cannot make the two hosts; the message is one line saying why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {msg[0] if msg else 'exit ' + str(proc.returncode)}")
    return proc


def unavailable_reason() -> "str | None":
    """None when this machine can make the hosts (root, ``ip netns``, ``tc``), else one line saying why."""
    if os.geteuid() != 0:
        return "the two-host harness needs root (it creates network namespaces and a veth pair); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the two-host harness needs `{tool}` (iproute2) on PATH; install iproute2"
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"`ip netns` is unavailable here: {(proc.stderr or proc.stdout).strip()[:200]}"
    return None


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (a link delay); False when it cannot be told."""
    try:
        import gzip
        with gzip.open("/proc/config.gz", "rt") as f:
            config = f.read()
    except OSError:
        return shutil.which("modprobe") is not None  # a modular kernel: try it
    return "CONFIG_NET_SCH_NETEM=y" in config or "CONFIG_NET_SCH_NETEM=m" in config


def _rate_bytes(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 10gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    per_s = float(m.group(1)) * scale
    return per_s / 8 if m.group(3) == "bit" else per_s


class TwoHosts:
    """Two namespaces joined by a veth pair; see the module docstring. Use it as a context manager."""

    def __init__(self, rate: "str | None" = "1gbit", delay_ms: float = 0.0, grace_s: float = 3.0):
        if rate is not None:
            _rate_bytes(rate)  # fail early on a bad spelling
        self.rate, self.delay_ms, self.grace_s = rate, float(delay_ms), grace_s
        tag = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self._ns = (f"{tag}-0", f"{tag}-1")
        self.ifname = IFNAME
        self._procs: "list[subprocess.Popen]" = []
        self._created: "list[str]" = []
        self._old_handlers: dict = {}
        self._closed = True

    # -- what a caller uses ------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return self._ns[i]

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def popen(self, i: int, cmd, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(cmd, **kwargs)`` inside host ``i``, in a new session (its own process group)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self._ns[i], *cmd], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, cmd, timeout: "float | None" = None, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` inside host ``i``; on a timeout the command's process group is killed first."""
        input_ = kwargs.pop("input", None)
        if kwargs.pop("capture_output", False):
            kwargs.setdefault("stdout", subprocess.PIPE)
            kwargs.setdefault("stderr", subprocess.PIPE)
        if input_ is not None:
            kwargs.setdefault("stdin", subprocess.PIPE)
        proc = self.popen(i, cmd, **kwargs)
        try:
            out, err = proc.communicate(input_, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, 0)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def pids(self, i: int) -> "list[int]":
        proc = _ip("netns", "pids", self._ns[i], check=False)
        return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []

    def kill_host(self, i: int) -> None:
        """SIGKILL every process inside host ``i`` (the host dies; its namespace and link stay)."""
        for _ in range(20):  # a dying parent may still fork; repeat until the namespace is empty
            pids = self.pids(i)
            if not pids:
                return
            for pid in pids:
                _signal_pid(pid, signal.SIGKILL)
            time.sleep(0.05)

    def link_down(self) -> None:
        for i in (0, 1):
            _ip("-n", self._ns[i], "link", "set", self.ifname, "down", check=False)

    # -- set-up and teardown -----------------------------------------------------------------------
    def __enter__(self) -> "TwoHosts":
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        if self.delay_ms > 0 and not netem_available():
            raise HostsUnavailable(f"delay_ms={self.delay_ms:g} needs netem, which this kernel lacks "
                                   "(CONFIG_NET_SCH_NETEM); use delay_ms=0 here")
        self._closed = False
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self._ns:
            _ip("netns", "add", ns)
            self._created.append(ns)
        a, b = self._ns
        _ip("link", "add", self.ifname, "netns", a, "type", "veth", "peer", "name", self.ifname, "netns", b)
        for i, ns in enumerate(self._ns):
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/30", "dev", self.ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", self.ifname, "up")
            self._shape(ns)

    def _shape(self, ns: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ifname]
        netem = ["netem", "delay", f"{self.delay_ms:g}ms", "limit", "100000"]
        steps = []
        if self.rate is not None:
            # burst: 1 ms of the rate, at least one 64 KiB GSO packet; the queue holds 100 ms of it
            burst = max(int(_rate_bytes(self.rate) / 1000), 65536)
            steps.append(tc + ["root", "handle", "1:", "tbf", "rate", self.rate, "burst", str(burst),
                               "latency", "100ms"])
            if self.delay_ms > 0:
                steps.append(tc + ["parent", "1:1", "handle", "10:"] + netem)
        elif self.delay_ms > 0:
            steps.append(tc + ["root", "handle", "1:"] + netem)
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise HostsUnavailable(f"`{' '.join(cmd[4:])}` failed: {proc.stderr.strip()[:200]}")

    def close(self) -> None:
        """Kill what runs in the hosts and delete them; safe to call twice, and from a signal handler."""
        if self._closed:
            return
        self._closed = True
        try:
            for proc in self._procs:
                if proc.poll() is None:
                    _kill_group(proc, self.grace_s)
            for i, ns in enumerate(self._ns):
                if ns in self._created:
                    self.kill_host(i)
            for ns in self._created:
                _ip("netns", "del", ns, check=False)
            self._created.clear()
        finally:
            self._restore_handlers()
            atexit.unregister(self.close)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum, frame):
            raise SystemExit(128 + signum)  # unwinds through __exit__, which tears down

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of ``proc`` (it leads its session), then SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stale_namespaces() -> "list[str]":
    """Namespaces this harness made whose creating process no longer runs."""
    proc = _ip("netns", "list", check=False)
    out = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(name)
    return out


def cleanup_stale() -> "list[str]":
    """Kill the processes in, and delete, the namespaces of dead harness processes; returns their names."""
    names = stale_namespaces()
    for ns in names:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            _signal_pid(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="tbf rate of each end, e.g. 100mbit, 1gbit; 'none': unlimited")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way netem delay of each end (needs netem)")
    p.add_argument("--host0", help="command for host 0 (a shell-quoted string)")
    p.add_argument("--host1", help="command for host 1")
    p.add_argument("--timeout", type=float, default=None, help="seconds before both commands are killed")
    p.add_argument("--check", action="store_true", help="say whether this machine can make the hosts, and exit")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed harness runs")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"hosts.py: {reason}", file=sys.stderr)
        return 2
    if args.check:
        print(f"hosts.py: two hosts can be made here; link delay {'available' if netem_available() else 'unavailable (no netem)'}")
        return 0
    if args.cleanup:
        names = cleanup_stale()
        print(f"hosts.py: removed {len(names)} stale namespace(s){': ' + ', '.join(names) if names else ''}")
        return 0
    if not (args.host0 and args.host1):
        p.error("give --host0 and --host1 (or --check / --cleanup)")
    rate = None if args.rate.lower() == "none" else args.rate
    try:
        with TwoHosts(rate=rate, delay_ms=args.delay_ms) as h:
            subst = {"addr0": h.addr(0), "addr1": h.addr(1), "ifname": h.ifname}
            procs = []
            for i, cmd in enumerate((args.host0, args.host1)):
                env = dict(os.environ, HOST0_ADDR=h.addr(0), HOST1_ADDR=h.addr(1), HOST_IFNAME=h.ifname,
                           HOST_RANK=str(i))
                procs.append(h.popen(i, shlex.split(cmd.format(rank=i, **subst)), env=env))
            deadline = None if args.timeout is None else time.monotonic() + args.timeout
            codes = []
            for proc in procs:
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                try:
                    codes.append(proc.wait(timeout=left))
                except subprocess.TimeoutExpired:
                    print(f"hosts.py: timed out after {args.timeout:g} s; killing both hosts", file=sys.stderr)
                    return 124
            return next((c for c in codes if c != 0), 0)
    except (HostsUnavailable, ValueError) as e:
        print(f"hosts.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
