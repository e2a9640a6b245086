"""The two-host harness (benchmarks/hosts.py): two network namespaces joined by a rate-limited veth pair.

Runs as root on a machine with ``ip netns`` and ``tc`` (the CI machine is one); elsewhere every test
but the refusal one is skipped with the harness's own reason. Each test builds and tears down its hosts
in well under a second.
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

# the rate-limit check: a 100 Mbit/s link, 4 MiB sent (about 0.35 s); the measured rate may not
# exceed the limit by more than this factor (tbf's one burst of 64 KiB is 1.6% of the transfer)
RATE = "100mbit"
RATE_BITS = 100e6
RATE_SLACK = 1.25
TRANSFER = 4 << 20

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


@needs_hosts
def test_teardown_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with hosts.TwoHosts(rate="1gbit") as h:
            names = {h.ns(0), h.ns(1)}
            procs = [h.popen(i, ["sleep", "300"]) for i in (0, 1)]
            raise RuntimeError("boom")
    assert not names & _namespaces()
    assert not any(_alive(p.pid) for p in procs)


_HARNESS = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    import hosts
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with hosts.TwoHosts(rate="1gbit") as h:
        pids = [h.popen(i, ["sleep", "300"], **quiet).pid for i in (0, 1)]
        # a grandchild in its own session: in host 1's namespace but outside the process groups started
        stray = h.popen(1, ["sh", "-c", "setsid sleep 301 & wait"], **quiet).pid
        print(h.ns(0), h.ns(1), *pids, stray, flush=True)
        time.sleep(300)
""")


@needs_hosts
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_teardown_after_a_signal_to_the_process_running_the_harness(sig, tmp_path):
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-c", _HARNESS, str(ROOT / "benchmarks")], stdout=subprocess.PIPE,
                            stderr=err, text=True)
    try:
        fields = proc.stdout.readline().split()
        assert len(fields) == 5, (fields, (tmp_path / "stderr").read_text())
        names, pids = set(fields[:2]), [int(p) for p in fields[2:]]
        assert names <= _namespaces()
        time.sleep(0.3)  # let the stray sleeper start
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    stderr = (tmp_path / "stderr").read_text()[-2000:]
    left = names & _namespaces()
    if left:  # remove what the broken harness left, then fail
        for ns in left:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns])
    assert not left, stderr
    assert not any(_alive(p) for p in pids), stderr


@needs_hosts
def test_delay_refused_in_one_line_without_netem():
    if hosts.netem_available():
        pytest.skip("this kernel has netem: a delay is allowed")
    with pytest.raises(hosts.HostsUnavailable, match="netem") as e:
        with hosts.TwoHosts(delay_ms=1):
            pass
    assert "\n" not in str(e.value)
