"""The two-host harness (benchmarks/hosts.py): two network namespaces joined by a rate-limited link.

The link is a veth pair, or (``link="tun"``, or any ``delay_ms`` > 0) a TUN device in each namespace
with the harness's userspace wire between them, which holds every packet for the one-way delay.
Runs as root on a machine with ``ip netns`` and ``tc`` (the CI machine is one), the wire's tests also
with ``/dev/net/tun``; elsewhere every test but the refusal one is skipped with the harness's own
reason. Each test builds and tears down its hosts in well under a second, the wire's in 1-2 s.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hosts  # noqa: E402

REASON = hosts.unavailable_reason()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"two-host harness: {REASON}")
TUN_REASON = REASON or hosts.unavailable_reason(link="tun")
needs_tun = pytest.mark.skipif(TUN_REASON is not None, reason=f"two-host harness, TUN link: {TUN_REASON}")
LINKS = [pytest.param("veth", marks=needs_hosts), pytest.param("tun", marks=needs_tun)]

# the rate-limit check: a 100 Mbit/s link, 4 MiB sent (about 0.35 s); the measured rate may not
# exceed the limit by more than this factor (tbf's one burst of 64 KiB is 1.6% of the transfer)
RATE = "100mbit"
RATE_BITS = 100e6
RATE_SLACK = 1.25
TRANSFER = 4 << 20

# the wire: 1 ms each way is a round trip of at least 2 ms; what Python, select() and two TCP stacks
# add on top stays far under the upper bound (median 2.23-2.46 ms measured on an idle machine)
DELAY_MS = 1.0
RTT_BOUNDS = (2.0e-3, 6.0e-3)
RTT_FREE = 1.5e-3  # the same wire at 0 ms (0.09-0.14 ms measured): the delay above is the wire's
# a 1 Gbit/s tbf on each TUN's egress: a TCP bulk transfer of 32 MiB through the wire (0.27 s at the
# rate) lands in this band of the rate. Measured 0.88-0.94 Gbit/s with 0 or 1 ms of delay, as through
# the veth with the same tbf (0.88-0.90); the lower bound leaves room for a loaded machine
WIRE_RATE, WIRE_RATE_BITS, WIRE_RATE_BAND = "1gbit", 1e9, (0.75, 1.03)
WIRE_TRANSFER = 32 << 20

_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
c.sendall(b"k")
print(n, flush=True)
"""
_CLIENT = """
import socket, sys, time
n = int(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
t = time.perf_counter()
s.sendall(b"x" * n)
s.shutdown(socket.SHUT_WR)
assert s.recv(1) == b"k"
print(n * 8 / (time.perf_counter() - t))
"""


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _send(h, n: int) -> float:
    """Bits per second of an ``n``-byte TCP transfer from host 1 to host 0."""
    server = h.popen(0, [sys.executable, "-c", _SERVER, h.addr(0), "5000"], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = h.run(1, [sys.executable, "-c", _CLIENT, h.addr(0), "5000", str(n)], timeout=60,
                   capture_output=True, text=True)
    assert client.returncode == 0, client.stderr
    assert int(server.stdout.readline()) == n
    server.wait(timeout=10)
    return float(client.stdout)


_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""
_PING = """
import socket, statistics, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for k in range(33):
    t = time.perf_counter()
    s.sendall(b"p")
    assert s.recv(1) == b"p"
    rtts.append(time.perf_counter() - t)
print(statistics.median(rtts[3:]))
"""
_UDP_RECV = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE (root): no drops at the receiver
s.bind((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
s.settimeout(10)
seq, last = [], int(sys.argv[3]) - 1
try:
    while not seq or seq[-1] != last:
        seq.append(int.from_bytes(s.recv(4096)[:4], "big"))
        s.settimeout(1.0)  # or the stream has ended when nothing came for this long
except TimeoutError:
    pass
print(" ".join(map(str, seq)), flush=True)
"""
# numbered datagrams, 50 a millisecond; halfway it prints "half" and waits for a line on stdin
_UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dst, n, pad = (sys.argv[1], int(sys.argv[2])), int(sys.argv[3]), b"x" * (int(sys.argv[4]) - 4)
for k in range(n):
    if k == n // 2:
        print("half", flush=True)
        sys.stdin.readline()
    s.sendto(k.to_bytes(4, "big") + pad, dst)
    if k % 50 == 49:
        time.sleep(0.001)
"""


def _rtt(h, port: int) -> float:
    """Median round trip (seconds) of a 1-byte TCP ping-pong from host 1 to host 0."""
    server = h.popen(0, [sys.executable, "-c", _ECHO, h.addr(0), str(port)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = h.run(1, [sys.executable, "-c", _PING, h.addr(0), str(port)], timeout=60, capture_output=True, text=True)
    assert client.returncode == 0, client.stderr
    server.wait(timeout=10)
    return float(client.stdout)


def _datagrams(h, n: int, size: int, at_half=lambda: None) -> "list[int]":
    """Numbers of the datagrams host 0 received, in arrival order, of ``n`` sent by host 1;
    ``at_half()`` runs when half are sent."""
    recv = h.popen(0, [sys.executable, "-c", _UDP_RECV, h.addr(0), "5001", str(n)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "listening"
    send = h.popen(1, [sys.executable, "-c", _UDP_SEND, h.addr(0), "5001", str(n), str(size)],
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert send.stdout.readline().strip() == "half"
    at_half()
    send.communicate("go\n", timeout=30)
    out, _ = recv.communicate(timeout=60)
    return [int(k) for k in out.split()]


def test_refuses_in_one_line_without_root():
    # the CLI as user nobody: exit 2 and one line naming what is missing. hosts.py needs only the
    # standard library, so a system Python nobody may run does (the venv may sit under /root)
    python = sys.executable
    if os.geteuid() == 0:
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
        if python is None:
            pytest.skip("no system python3 that user nobody can run")
    folder = tempfile.mkdtemp(prefix="hosts-nobody-")  # readable by nobody wherever the checkout is
    try:
        os.chmod(folder, 0o755)
        shutil.copy(ROOT / "benchmarks" / "hosts.py", folder)
        proc = subprocess.run([python, os.path.join(folder, "hosts.py"), "--check"], capture_output=True,
                              text=True, timeout=60, preexec_fn=(lambda: (os.setgid(65534), os.setuid(65534)))
                              if os.geteuid() == 0 else None)
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], proc.stderr


@needs_hosts
def test_hosts_reach_each_other_and_leave_nothing_behind():
    with hosts.TwoHosts(rate=None) as h:
        names = {h.ns(0), h.ns(1)}
        assert names <= _namespaces()
        sleeper = h.popen(1, ["sleep", "300"])
        # `ip netns exec` enters the namespace and then execs: give a loaded machine time to get there
        deadline = time.monotonic() + 10
        while sleeper.pid not in h.pids(1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in h.pids(1) and h.pids(0) == []
        assert _send(h, 1 << 16) > 0  # TCP from host 1 to host 0's address
        # each host sees its own loopback and its own end of the link only
        out = h.run(0, ["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        assert "127.0.0.1" in out and h.addr(0) in out and h.addr(1) not in out
    assert not names & _namespaces()
    assert not _alive(sleeper.pid)


@needs_hosts
def test_rate_limit_holds_roughly():
    with hosts.TwoHosts(rate=RATE) as h:
        limited = _send(h, TRANSFER)
    with hosts.TwoHosts(rate=None) as h:
        free = _send(h, TRANSFER)
    assert limited <= RATE_SLACK * RATE_BITS, f"{limited / 1e6:.1f} Mbit/s on a {RATE} link"
    assert free > RATE_SLACK * RATE_BITS, f"unlimited link: {free / 1e6:.1f} Mbit/s"  # the check can fail


@needs_tun
def test_wire_delay_sets_the_round_trip():
    # a delay without netem: the TUN link and its wire, 1 ms each way
    with hosts.TwoHosts(rate=WIRE_RATE, delay_ms=DELAY_MS) as h:
        assert h.link == "tun" and h.ifname == hosts.TUN_IFNAME
        delayed = _rtt(h, 5002)
        h.set_delay(0)
        free = _rtt(h, 5003)
    assert RTT_BOUNDS[0] <= delayed < RTT_BOUNDS[1], f"round trip {delayed * 1e3:.2f} ms at {DELAY_MS:g} ms each way"
    assert free < RTT_FREE, f"round trip {free * 1e3:.2f} ms with no delay on the wire"


@needs_tun
def test_wire_carries_tcp_at_the_link_rate():
    with hosts.TwoHosts(rate=WIRE_RATE, link="tun", delay_ms=DELAY_MS) as h:
        bits = _send(h, WIRE_TRANSFER)
        stats = h.wire_stats()
    lo, hi = WIRE_RATE_BAND
    assert lo * WIRE_RATE_BITS <= bits <= hi * WIRE_RATE_BITS, f"{bits / 1e9:.3f} Gbit/s through the wire at {WIRE_RATE}"
    assert stats["dropped"] == 0 and stats["write_errors"] == 0, stats
    assert stats["bytes"][1] >= WIRE_TRANSFER and stats["packets"][1] >= WIRE_TRANSFER / hosts.TUN_MTU, stats
    assert stats["cpu_user_s"] + stats["cpu_sys_s"] > 0, stats


@needs_tun
def test_wire_keeps_order_when_the_delay_shrinks():
    # 500 ms each way for the first half, then 0: the second half must queue behind the first
    with hosts.TwoHosts(rate=WIRE_RATE, link="tun", delay_ms=500) as h:
        got = _datagrams(h, 2000, 200, at_half=lambda: h.set_delay(0))
        stats = h.wire_stats()
    assert got == list(range(2000)), f"{len(got)} datagrams, first out of order at " \
        f"{next((i for i, k in enumerate(got) if k != i), None)}"
    assert stats["dropped"] == 0, stats


@needs_tun
def test_wire_drops_only_past_its_queue_bound_and_counts_it():
    # 64 KiB of queue and 500 ms each way: 1000 datagrams of 1 KB sent in ~20 ms cannot all wait
    with hosts.TwoHosts(rate=WIRE_RATE, link="tun", delay_ms=500, wire_queue_bytes=64 << 10) as h:
        got = _datagrams(h, 1000, 1000)
        stats = h.wire_stats()
    assert 0 < len(got) < 1000 and got == sorted(set(got)), got[:20]
    assert stats["dropped"] == 1000 - len(got), (len(got), stats)
    assert stats["max_held_bytes"] <= 64 << 10, stats


@pytest.mark.parametrize("link", LINKS)
def test_teardown_after_an_exception(link):
    with pytest.raises(RuntimeError, match="boom"):
        with hosts.TwoHosts(rate="1gbit", link=link) as h:
            names = {h.ns(0), h.ns(1)}
            procs = [h.popen(i, ["sleep", "300"]) for i in (0, 1)]
            wire = h.wire_pid
            raise RuntimeError("boom")
    assert not names & _namespaces()
    assert not any(_alive(p.pid) for p in procs)
    assert (wire is None) == (link == "veth") and not (wire and _alive(wire))
    assert not _tun_devices()


def _tun_devices() -> "list[str]":
    """The wire's TUN devices still in this (the root) namespace: none once a harness is set up or gone."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [f.split(":")[1].strip() for f in out.splitlines() if f.split(":")[1].strip().startswith(hosts.TUN_TMP_PREFIX)]


_HARNESS = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    import hosts
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with hosts.TwoHosts(rate="1gbit", link=sys.argv[2]) as h:
        pids = [h.popen(i, ["sleep", "300"], **quiet).pid for i in (0, 1)]
        # a grandchild in its own session: in host 1's namespace but outside the process groups started
        stray = h.popen(1, ["sh", "-c", "setsid sleep 301 & wait"], **quiet).pid
        print(h.ns(0), h.ns(1), *pids, stray, h.wire_pid or 0, flush=True)
        time.sleep(300)
""")


def _start_harness(link: str, tmp_path) -> "tuple[subprocess.Popen, set, list, int]":
    """A harness process holding two hosts with a sleeper in each (and a stray one in host 1);
    returns it, its namespaces, the sleepers' pids and its wire's pid (0 without one)."""
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-c", _HARNESS, str(ROOT / "benchmarks"), link], stdout=subprocess.PIPE,
                            stderr=err, text=True)
    err.close()
    fields = proc.stdout.readline().split()
    assert len(fields) == 6, (fields, (tmp_path / "stderr").read_text())
    return proc, set(fields[:2]), [int(p) for p in fields[2:5]], int(fields[5])


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_teardown_after_a_signal_to_the_process_running_the_harness(sig, link, tmp_path):
    proc = None
    try:
        proc, names, pids, wire = _start_harness(link, tmp_path)
        assert names <= _namespaces()
        time.sleep(0.3)  # let the stray sleeper start
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
    stderr = (tmp_path / "stderr").read_text()[-2000:]
    left = names & _namespaces()
    if left:  # remove what the broken harness left, then fail
        for ns in left:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns])
    assert not left, stderr
    assert not any(_alive(p) for p in pids + [wire] if p), stderr
    assert not _tun_devices(), stderr


@needs_tun
def test_a_killed_harness_leaves_no_wire_and_cleanup_removes_its_hosts(tmp_path):
    # SIGKILL: no teardown runs. The wire sees its control socket close and exits (its TUN devices go
    # with it); the namespaces stay until --cleanup
    proc, names, pids, wire = _start_harness("tun", tmp_path)
    time.sleep(0.3)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(wire) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(wire)
    assert names <= _namespaces()
    assert names <= set(hosts.cleanup_stale())
    assert not names & _namespaces()
    assert not any(_alive(p) for p in pids)
    assert not _tun_devices()


@needs_hosts
def test_veth_delay_refused_in_one_line_without_netem():
    if hosts.netem_available():
        pytest.skip("this kernel has netem: a delay on the veth is allowed")
    with pytest.raises(hosts.HostsUnavailable, match="netem.*link='tun'") as e:
        with hosts.TwoHosts(delay_ms=1, link="veth"):
            pass
    assert "\n" not in str(e.value)
