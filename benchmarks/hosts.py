"""Two hosts on one machine: two network namespaces joined by a link with a chosen rate and latency.

Every multi-rank test on loopback sends bytes for free; here a byte costs what the link says. As root,
``TwoHosts`` makes two namespaces (each its own TCP stack and loopback), joins them with a link, puts
an address of a private /30 on each end (10.47.0.1 on host 0, 10.47.0.2 on host 1; the two namespaces
are the only ones that hold them, so nothing outside them is ever contacted), limits each end's egress
with a ``tc`` ``tbf`` (the rate), and runs commands in either host. The link is one of:

* ``veth`` (the default without a delay): a veth pair; a one-way delay there needs ``netem`` in the
  kernel (``CONFIG_NET_SCH_NETEM``), a child ``netem`` qdisc under the ``tbf``.
* ``tun`` (the default with ``delay_ms > 0``): a TUN device in each namespace (point-to-point, MTU
  65000, IP packets without a header) and the *wire*, one child process in the root namespace that
  holds both devices' file descriptors and copies each packet from one to the other after the one-way
  delay (netem's model: the ``tbf`` serializes, then the packet travels ``delay_ms``; a round trip is
  twice the delay). The wire keeps each direction's order (a packet never leaves before the one read
  before it, even when the delay is lowered), and drops a packet only when the bytes it holds in
  that direction would exceed ``wire_queue_bytes`` (counted, like a full queue). No kernel support
  beyond TUN is needed. ``h.set_delay(ms)`` changes the delay while the hosts run.

Leaving the ``with`` block, however it is left (normal end, an exception, Ctrl-C, SIGTERM, SIGHUP),
kills every process it started (their process groups) and anything else still inside the namespaces
(``ip netns pids``), stops the wire, then deletes both namespaces, which deletes the link with them.

API::

    from hosts import TwoHosts, HostsUnavailable, unavailable_reason

    reason = unavailable_reason()          # None, or one line: why this machine cannot make hosts
    with TwoHosts(rate="1gbit", delay_ms=0) as h:
        h.addr(0), h.addr(1)               # "10.47.0.1", "10.47.0.2"
        h.ifname                           # "veth0" (or "tun0") on both hosts (GLOO_SOCKET_IFNAME)
        h.ns(0)                            # the namespace's name, unique per process and instance
        p = h.popen(0, ["python", "-c", "..."], env=..., stdout=...)   # subprocess.Popen in host 0,
                                           # its own session (process group), killed at teardown
        r = h.run(1, cmd, timeout=30, capture_output=True, text=True)  # subprocess.run in host 1
        h.kill_host(1)                     # SIGKILL every process inside host 1 (a host that dies)
        h.link_down()                      # or: take the link down (both ends)
        h.pids(0)                          # pids inside host 0 now
    with TwoHosts(rate="1gbit", delay_ms=1) as h:   # the TUN link and its wire
        h.set_delay(0)                     # the wire's one-way delay, both directions, from now on
        h.wire_stats()                     # packets/bytes per direction, drops, the wire's CPU seconds

``TwoHosts(rate=None)`` leaves the link unlimited (on ``tun`` the wire's own speed is then the limit).
Any failure to build the hosts raises ``HostsUnavailable`` with one line (not root, no ``ip``/``tc``, no
netns support, a missing qdisc, no ``/dev/net/tun``). Importable by path (``benchmarks/`` is not a
package): ``sys.path.insert(0, "benchmarks"); import hosts``.

CLI (the two commands run at once, one per host; ``{addr0}``, ``{addr1}``, ``{ifname}`` and ``{rank}``
are substituted in each, and ``HOST0_ADDR``, ``HOST1_ADDR``, ``HOST_IFNAME``, ``HOST_RANK`` are set in
their environments; exit status: the first non-zero one of the two, or 0)::

    python benchmarks/hosts.py --check                       # can this machine make the hosts?
    python benchmarks/hosts.py --rate 1gbit --host0 'CMD' --host1 'CMD'
    python benchmarks/hosts.py --rate 1gbit --delay-ms 1 --host0 'CMD' --host1 'CMD'   # TUN + wire
    python benchmarks/hosts.py --cleanup                     # remove namespaces of dead harness processes

A harness killed with SIGKILL cannot tear down: its wire notices (its control socket closes) and
exits, which removes the TUN devices; ``--cleanup`` (or ``cleanup_stale()``) removes the namespaces
whose creating process is gone.
"""

import argparse
import atexit
import collections
import ctypes
import fcntl
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

PREFIX = "fp4h"
SUBNET = "10.47.0"  # a private /30: .1 on host 0, .2 on host 1
IFNAME = "veth0"
LINKS = ("veth", "tun")
TUN_IFNAME = "tun0"
TUN_MTU = 65000  # large frames: 1 Gbit/s is ~2,000 packets a second for the wire to copy
TUN_TMP_PREFIX = "fp4w"  # a TUN device's name in the root namespace, until it moves into its host
WIRE_QUEUE_BYTES = 64 << 20  # per direction: 0.5 s of a 1 Gbit/s link
TUNSETIFF = 0x400454CA  # _IOW('T', 202, int)
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
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


def unavailable_reason(link: str = "veth") -> "str | None":
    """None when this machine can make the hosts (root, ``ip netns``, ``tc``; for ``link="tun"`` also
    ``/dev/net/tun``), else one line saying why."""
    if os.geteuid() != 0:
        return "the two-host harness needs root (it creates network namespaces and a veth pair); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the two-host harness needs `{tool}` (iproute2) on PATH; install iproute2"
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return f"`ip netns` is unavailable here: {(proc.stderr or proc.stdout).strip()[:200]}"
    return _tun_unavailable_reason() if link == "tun" else None


def _tun_unavailable_reason() -> "str | None":
    """Creates ``/dev/net/tun`` where a container lacks the node (as ``modprobe tun`` would); None when
    it opens."""
    path = "/dev/net/tun"
    try:
        if not os.path.exists(path):
            os.makedirs("/dev/net", exist_ok=True)
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(10, 200))
        os.close(os.open(path, os.O_RDWR))
    except OSError as e:
        return f"the TUN link needs {path} (CONFIG_TUN; `mknod {path} c 10 200`): {e.strerror}"
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


def tbf_burst(rate: str, burst_ms: float = 1.0) -> int:
    """The ``tbf`` burst in bytes for ``rate``: ``burst_ms`` of it, at least one 64 KiB GSO packet."""
    return max(int(_rate_bytes(rate) * burst_ms / 1000), 65536)


def _open_tun(name: str) -> int:
    """A new TUN device ``name`` in this namespace (IP packets, no packet-info header); its fd, non-blocking.
    The device lives as long as the fd (it is not persistent), wherever the device is moved."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError as e:
        os.close(fd)
        raise HostsUnavailable(f"creating TUN device {name} failed: {e.strerror}") from None
    return fd


class TwoHosts:
    """Two namespaces joined by a link; see the module docstring. Use it as a context manager."""

    def __init__(self, rate: "str | None" = "1gbit", delay_ms: float = 0.0, grace_s: float = 3.0,
                 link: "str | None" = None, wire_queue_bytes: int = WIRE_QUEUE_BYTES):
        if rate is not None:
            _rate_bytes(rate)  # fail early on a bad spelling
        link = link or ("tun" if delay_ms > 0 else "veth")
        if link not in LINKS:
            raise ValueError(f"link {link!r}: choose one of {LINKS}")
        self.rate, self.delay_ms, self.grace_s, self.link = rate, float(delay_ms), grace_s, link
        self.wire_queue_bytes = int(wire_queue_bytes)
        n = next(_counter)
        tag = f"{PREFIX}-{os.getpid()}-{n}"
        self._ns = (f"{tag}-0", f"{tag}-1")
        self._tun_names = tuple(f"{TUN_TMP_PREFIX}{os.getpid():x}-{n % 1000}{i}" for i in (0, 1))
        self.ifname = TUN_IFNAME if link == "tun" else IFNAME
        self._procs: "list[subprocess.Popen]" = []
        self._created: "list[str]" = []
        self._tun_fds: "list[int]" = []
        self._wire: "subprocess.Popen | None" = None
        self._ctl: "socket.socket | None" = None
        self._ctl_lines = None
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

    @property
    def wire_pid(self) -> "int | None":
        """The wire process's pid (``tun`` link), else None."""
        return self._wire.pid if self._wire is not None else None

    def set_delay(self, delay_ms: float) -> None:
        """The one-way delay of both directions from now on (``tun`` link only; packets already on the
        wire keep theirs, and none overtakes another)."""
        if self.link != "tun":
            raise HostsUnavailable("set_delay needs link='tun' (a veth link's delay is fixed when it is made)")
        self._wire_call(f"delay {float(delay_ms)!r}")
        self.delay_ms = float(delay_ms)

    def wire_stats(self) -> "dict | None":
        """The wire's counters (``tun`` link; None on a veth): ``packets`` and ``bytes`` per direction
        ([host 0 -> 1, host 1 -> 0]), ``dropped`` (queue bound), ``write_errors`` (a link that is down),
        ``max_held_bytes``, ``delay_ms``, how late packets left (``late_ms_sum`` over all delivered and
        ``late_ms_max``), and its own ``cpu_user_s`` / ``cpu_sys_s`` / ``wall_s`` so far (system time
        includes the receiving host's kernel work: a TUN write delivers the packet), ``sched`` ("fifo":
        it runs at real-time priority 1, else "other"). All but the two maxima, ``delay_ms`` and
        ``sched`` are totals since the hosts were made."""
        return json.loads(self._wire_call("stats")) if self.link == "tun" else None

    def _wire_call(self, cmd: str) -> str:
        if self._ctl is None:
            raise HostsUnavailable("the wire is not running (use the hosts inside their `with` block)")
        self._ctl.sendall(cmd.encode() + b"\n")
        reply = self._ctl_lines.readline().strip()
        if not reply or reply.startswith("error"):
            raise HostsUnavailable(f"the wire did not answer `{cmd}`: {reply or 'it exited'}")
        return reply

    # -- set-up and teardown -----------------------------------------------------------------------
    def __enter__(self) -> "TwoHosts":
        reason = unavailable_reason(self.link)
        if reason:
            raise HostsUnavailable(reason)
        if self.link == "veth" and self.delay_ms > 0 and not netem_available():
            raise HostsUnavailable(f"delay_ms={self.delay_ms:g} on a veth needs netem, which this kernel lacks "
                                   "(CONFIG_NET_SCH_NETEM); use link='tun' (the harness's wire) for a delay")
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
        if self.link == "tun":
            self._build_tun()
            return
        a, b = self._ns
        _ip("link", "add", self.ifname, "netns", a, "type", "veth", "peer", "name", self.ifname, "netns", b)
        for i, ns in enumerate(self._ns):
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/30", "dev", self.ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", self.ifname, "up")
            self._shape(ns, self.delay_ms)

    def _build_tun(self) -> None:
        """A TUN device per host, made here in the root namespace (its fd stays attached when the device
        moves), then the wire between the two fds."""
        for i, ns in enumerate(self._ns):
            tmp = self._tun_names[i]
            self._tun_fds.append(_open_tun(tmp))
            _ip("link", "set", "dev", tmp, "netns", ns)
            _ip("-n", ns, "link", "set", "dev", tmp, "name", self.ifname)
            _ip("-n", ns, "link", "set", "dev", self.ifname, "mtu", str(TUN_MTU))
            _ip("-n", ns, "addr", "add", self.addr(i), "peer", f"{self.addr(1 - i)}/32", "dev", self.ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", self.ifname, "up")
            self._shape(ns, 0.0)  # the wire delays; tc only limits the rate
        mine, theirs = socket.socketpair()
        self._ctl, self._ctl_lines = mine, mine.makefile("r")
        fds = (*self._tun_fds, theirs.fileno())
        # its own session: a Ctrl-C at the terminal reaches the harness, which stops the wire last
        self._wire = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--wire", ",".join(map(str, fds)),
                                       "--delay-ms", repr(self.delay_ms), "--queue-bytes", str(self.wire_queue_bytes)],
                                      pass_fds=fds, start_new_session=True, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL)
        theirs.close()
        for fd in self._tun_fds:  # the wire holds the devices now: they go when it does
            os.close(fd)
        self._tun_fds.clear()
        if self._ctl_lines.readline().strip() != "ready":
            raise HostsUnavailable(f"the wire process did not start (exit code {self._wire.poll()})")

    def _stop_wire(self) -> None:
        """Close the wire's control socket (it exits on that) and wait for it; SIGKILL if it lingers."""
        for fd in self._tun_fds:
            os.close(fd)
        self._tun_fds.clear()
        if self._ctl is not None:
            self._ctl_lines.close()
            self._ctl.close()
            self._ctl = self._ctl_lines = None
        if self._wire is not None and self._wire.poll() is None:
            try:
                self._wire.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._wire.kill()
                self._wire.wait(timeout=5)

    def _shape(self, ns: str, delay_ms: float) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.ifname]
        netem = ["netem", "delay", f"{delay_ms:g}ms", "limit", "100000"]
        steps = []
        if self.rate is not None:
            # burst: 1 ms of the rate, at least one 64 KiB GSO packet; the queue holds 100 ms of it
            burst = tbf_burst(self.rate)
            steps.append(tc + ["root", "handle", "1:", "tbf", "rate", self.rate, "burst", str(burst),
                               "latency", "100ms"])
            if delay_ms > 0:
                steps.append(tc + ["parent", "1:1", "handle", "10:"] + netem)
        elif delay_ms > 0:
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
            self._stop_wire()
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


# ---------------------------------------------------------------------------------------------
# the wire: a child process holding both TUN devices' fds


class Wire:
    """Copies IP packets between two TUN fds, each after its direction's one-way delay, in order.

    Direction ``i`` carries what host ``i`` sends (read from ``fds[i]``) to host ``1 - i`` (written to
    ``fds[1 - i]``). A packet read at time t is due at max(t + delay, the due time of the packet read
    before it): FIFO, so lowering the delay never reorders. ``select`` (microsecond timeouts; poll and
    epoll round to milliseconds) sleeps until the next packet is due or one arrives. A packet that
    would make a direction hold more than ``queue_bytes`` is dropped and counted. The control socket
    takes ``delay MS`` and ``stats`` lines and answers each with one line; when it closes, the wire exits.
    """

    def __init__(self, fds: "tuple[int, int]", ctl: socket.socket, delay_ms: float, queue_bytes: int,
                 sched: str = "other"):
        self.fds, self.ctl, self.queue_bytes, self.sched = fds, ctl, queue_bytes, sched
        self.delay_s = delay_ms / 1e3
        self.lines = (collections.deque(), collections.deque())  # (due time, packet) per direction
        self.held = [0, 0]
        self.packets, self.bytes = [0, 0], [0, 0]
        self.dropped = self.write_errors = self.max_held = 0
        self.late_sum = self.late_max = 0.0  # seconds each packet left after its due time
        self.t0 = time.monotonic()
        self._ctl_buf = b""

    def run(self) -> None:
        readable = [*self.fds, self.ctl.fileno()]
        self.ctl.sendall(b"ready\n")
        while True:
            r, _, _ = select.select(readable, [], [], self._timeout())
            for i, fd in enumerate(self.fds):
                if fd in r and not self._take(i) and fd in readable:
                    readable.remove(fd)  # the device is gone (its namespace deleted): stop reading it
            if self.ctl.fileno() in r and not self._control():
                return
            self._deliver(time.monotonic())

    def _timeout(self) -> "float | None":
        due = [line[0][0] for line in self.lines if line]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _take(self, i: int) -> bool:
        """Read what host ``i`` has sent (up to 64 packets); False when its device is gone."""
        line, now = self.lines[i], time.monotonic()
        for _ in range(64):
            try:
                pkt = os.read(self.fds[i], 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if self.held[i] + len(pkt) > self.queue_bytes:
                self.dropped += 1
                continue
            due = now + self.delay_s
            line.append((max(due, line[-1][0]) if line else due, pkt))
            self.held[i] += len(pkt)
            self.max_held = max(self.max_held, self.held[i])
        return True

    def _deliver(self, now: float) -> None:
        for i, line in enumerate(self.lines):
            while line and line[0][0] <= now:
                due, pkt = line.popleft()
                self.held[i] -= len(pkt)
                self.late_sum += now - due
                self.late_max = max(self.late_max, now - due)
                try:
                    os.write(self.fds[1 - i], pkt)
                except OSError:  # the receiving end is down (link_down) or gone: the packet is lost
                    self.write_errors += 1
                    continue
                self.packets[i] += 1
                self.bytes[i] += len(pkt)

    def _control(self) -> bool:
        """Answer the control lines that have arrived; False when the harness closed the socket."""
        data = self.ctl.recv(4096)
        if not data:
            return False
        self._ctl_buf += data
        while b"\n" in self._ctl_buf:
            cmd, self._ctl_buf = self._ctl_buf.split(b"\n", 1)
            self.ctl.sendall(self._answer(cmd.decode().split()).encode() + b"\n")
        return True

    def _answer(self, words: "list[str]") -> str:
        if words[:1] == ["delay"] and len(words) == 2:
            self.delay_s = float(words[1]) / 1e3
            return "ok"
        if words == ["stats"]:
            t = os.times()
            return json.dumps({"packets": self.packets, "bytes": self.bytes, "dropped": self.dropped,
                               "write_errors": self.write_errors, "max_held_bytes": self.max_held,
                               "delay_ms": self.delay_s * 1e3, "late_ms_sum": self.late_sum * 1e3,
                               "late_ms_max": self.late_max * 1e3, "sched": self.sched,
                               "cpu_user_s": t.user, "cpu_sys_s": t.system,
                               "wall_s": time.monotonic() - self.t0})
        return f"error: unknown command {' '.join(words)!r}"


def _wire_main(spec: str, delay_ms: float, queue_bytes: int) -> int:
    fd0, fd1, ctl = (int(x) for x in spec.split(","))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops the wire (it closes the socket)
    try:  # wake up when a packet is due, not up to the default 50 us later
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
    except (OSError, AttributeError):
        pass
    # the wire is the network, not a host: as the kernel's softirq work for a veth does, it runs before
    # the ranks' compute (real-time priority 1: it uses a few % of a core, and the kernel's real-time
    # throttling bounds it). At normal priority a due packet waits for a CPU behind both ranks, which
    # lengthens the delay it was given
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        sched = "fifo"
    except (OSError, AttributeError):
        sched = "other"
    with socket.socket(fileno=ctl) as sock:
        Wire((fd0, fd1), sock, delay_ms, queue_bytes, sched).run()
    return 0


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--wire"]:  # the child TwoHosts starts: --wire FD0,FD1,CTL --delay-ms D --queue-bytes Q
        return _wire_main(argv[1], float(argv[3]), int(argv[5]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="tbf rate of each end, e.g. 100mbit, 1gbit; 'none': unlimited")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way delay of each direction (on the TUN link: the harness's wire; on a veth: netem)")
    p.add_argument("--link", choices=LINKS, default=None,
                   help="veth pair, or TUN devices joined by the harness's wire (default: tun with a delay, else veth)")
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
        tun = unavailable_reason("tun")
        print(f"hosts.py: two hosts can be made here; veth delay {'available' if netem_available() else 'unavailable (no netem)'}; "
              f"TUN link with the wire's delay {'available' if tun is None else 'unavailable: ' + tun}")
        return 0
    if args.cleanup:
        names = cleanup_stale()
        print(f"hosts.py: removed {len(names)} stale namespace(s){': ' + ', '.join(names) if names else ''}")
        return 0
    if not (args.host0 and args.host1):
        p.error("give --host0 and --host1 (or --check / --cleanup)")
    rate = None if args.rate.lower() == "none" else args.rate
    try:
        with TwoHosts(rate=rate, delay_ms=args.delay_ms, link=args.link) as h:
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
