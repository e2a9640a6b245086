"""The gradient-exchange benchmark over two hosts (benchmarks/bench_comm_hosts.py) runs end to end.

Its smallest configuration: the tiny LLaMA, DDP with ``trainer.grad_comm`` fp32 and fp8-e4m3, one
round on a 1 Gbit/s link between two namespaces (benchmarks/hosts.py): on the veth pair, and on the
TUN link whose userspace wire adds 0 and then 1 ms each way. The bytes checked are the link's own
counters, frames with their headers, not what the hooks count. Skipped with the harness's reason
where it cannot make hosts (not root, no ``ip netns``, no ``/dev/net/tun``). The codec runs eagerly
(``FP4LIGHTNING_COMPILE=0``, the same bits as compiled): bytes do not depend on it, and compiling would
cost minutes on a fresh machine.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_comm_hosts  # noqa: E402
import hosts  # noqa: E402

REASON = hosts.unavailable_reason()
TUN_REASON = REASON or hosts.unavailable_reason(link="tun")
RATE_BITS = 1e9
#: FP8 codes are a quarter of fp32's bytes; on the wire both carry the same small share of headers, and
#: the FP8 payload its fp32 scales: the measured ratio sits near 0.25 (0.2499 in one CI run, where the
#: fp32 exchange's frames carried a few more retransmissions or ACKs than the FP8 one's)
FP8_BYTES_RATIO = (0.24, 0.30)
#: frames carry the payload the hook counts plus TCP/IP headers and gloo's own messages: measured tx
#: over counted bytes of the fp32 all-reduce (1.002 measured: veth counts 64 KiB GSO segments, so
#: headers are few; at most ~4.4% with 1500-byte frames)
FRAME_OVERHEAD = (1.0, 1.10)


def _bench(tmp_path, *extra: str) -> "tuple[dict, str, int]":
    """The benchmark's smallest run with ``extra`` arguments: its JSON record, its stdout, its pid."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, FP4LIGHTNING_COMPILE="0", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "bench_comm_hosts.py"), "--model", "tiny",
                             "--variants", "fp32,fp8-e4m3", "--rates", "1gbit", "--steps", "1", "--warmup", "0",
                             "--json", str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # its SIGTERM handler tears the hosts down
        proc.communicate(timeout=60)
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith(f"{hosts.PREFIX}-{proc.pid}-")], "the benchmark left its namespaces behind"
    return json.loads(out.read_text()), stdout, proc.pid


def _check_phase(row: dict, phase: list) -> None:
    assert FP8_BYTES_RATIO[0] <= row["fp8/fp32 bytes"] <= FP8_BYTES_RATIO[1], row
    for host in phase:  # each host's own counters
        fp32 = host["fp32"][0]
        assert FRAME_OVERHEAD[0] < fp32["tx"] / fp32["counted"] <= FRAME_OVERHEAD[1], fp32
        # the link is limited: no step moved its bytes faster than 1 Gbit/s
        assert fp32["s"] >= 0.95 * fp32["tx"] * 8 / RATE_BITS, fp32


@pytest.mark.skipif(REASON is not None, reason=f"two-host harness: {REASON}")
def test_fp8_exchange_sends_a_quarter_of_fp32s_bytes_on_the_wire(tmp_path):
    rec, stdout, _ = _bench(tmp_path, "--pin", "--seq", "16", "--repeat", "2", "--burst-ms", "2")
    assert rec["rows"][0]["link"] == "veth"
    assert len(rec["runs"]) == 2 and "### Across the 2 runs" in stdout  # --repeat: two runs, then the summary
    values = [run["rows"][0]["fp8/fp32 time"] for run in rec["runs"]]
    across = bench_comm_hosts.across_runs([run["rows"] for run in rec["runs"]])
    row = next(r for r in across if r["ratio"] == "fp8/fp32 time")
    assert row["values"] == values and row["mean"] == pytest.approx(sum(values) / 2)
    assert row["ci95"][0] <= row["mean"] <= row["ci95"][1]
    assert "batch 1 x 16)" in stdout and "each host pinned to its own CPU(s)" in stdout
    assert "tbf burst 2 ms of the rate" in stdout and rec["raw"]["tbf_burst_bytes"] == [250_000]  # 2 ms of 1 Gbit/s
    assert rec["raw"]["tokens"] == 16  # the ranks trained on --seq tokens a step
    a, b = rec["raw"]["cpus"]  # --pin: each host on its own CPU
    assert len(a) == len(b) == 1 and not set(a) & set(b), rec["raw"]["cpus"]
    _check_phase(rec["rows"][0], rec["raw"]["phases"][0])
    assert "| fp8-e4m3 |" in stdout and "fp8/fp32 bytes" in stdout
    # the exchange's timeline: every bucket issued inside backward, each done after it was issued, the
    # buckets' bytes those the hook counted, and no bucket moved faster than the link
    for m in rec["raw"]["phases"][0][0]["fp8-e4m3"]:
        b = m["buckets"]
        assert b and sum(x[0] for x in b) == m["counted"], m
        assert all(0 <= x[1] <= m["backward_s"] + 1e-3 and x[2] > x[1] for x in b), b
        assert all(x[0] * 8 / (x[2] - x[1]) <= 1.05 * RATE_BITS for x in b if x[0] > 1e6), b
    t = bench_comm_hosts.timeline(rec["raw"]["phases"][0][0]["fp8-e4m3"])
    assert t["first_issued_ms"] <= t["last_issued_ms"] <= t["last_done_ms"] and t["buckets"] >= 1, t
    assert "Exchange timeline" in stdout and bench_comm_hosts.timeline([{"s": 0.1}]) is None  # no exchange: no row


@pytest.mark.skipif(TUN_REASON is not None, reason=f"two-host harness, TUN link: {TUN_REASON}")
def test_delay_phases_run_on_the_tun_wire(tmp_path):
    # without netem a delay used to be refused; now 0 and 1 ms each way run on the same wire, one phase each
    rec, stdout, _ = _bench(tmp_path, "--delay-ms", "0,1", "--nice-compute", "5")
    rows = rec["rows"]
    assert rec["raw"]["nice"] == [5, 5] and "training threads at nice 5" in stdout  # --nice-compute reached the ranks
    assert [(r["link"], r["rate"], r["delay_ms"]) for r in rows] == [("tun", "1gbit", 0.0), ("tun", "1gbit", 1.0)]
    for row, phase, wire in zip(rows, rec["raw"]["phases"], rec["raw"]["wire"]):
        _check_phase(row, phase)
        # the wire carried every byte both hosts counted, dropped none, and says what it cost
        sent = sum(host[v][0]["tx"] for host in phase for v in ("fp32", "fp8-e4m3"))
        assert wire["bytes"] >= sent and wire["dropped"] == 0 and wire["write_errors"] == 0, wire
        assert wire["cpu_user_s"] + wire["cpu_sys_s"] > 0, wire
    assert "| 1gbit +1 ms |" in stdout and "The wire over this phase" in stdout


def test_tbf_burst_rule_and_bad_rates():
    """One burst rule for the harness's link and the benchmark's rate changes: ``burst_ms`` of the rate, at
    least one 64 KiB packet; a rate tc would not read is refused when the command line is read."""
    assert hosts.tbf_burst("1gbit") == 125_000 and hosts.tbf_burst("1gbit", 10) == 1_250_000
    assert hosts.tbf_burst("100mbit") == 65_536
    with pytest.raises(ValueError, match="write it as tc does"):
        hosts.tbf_burst("1gbyte")
    with pytest.raises(SystemExit):
        bench_comm_hosts.main(["--rates", "1gbit,fast"])
