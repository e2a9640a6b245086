"""Gradient exchange between two hosts joined by a rate-limited link: where FP8's bytes cost time.

Two network namespaces ("hosts", :mod:`benchmarks.hosts`) joined by a link whose two directions are
each limited by a ``tc`` tbf: a veth pair (``--link veth``, the default without a delay), or a TUN
device per host joined by the harness's userspace wire, which holds every packet for the one-way
delay (``--link tun``, the default with a ``--delay-ms`` above 0; this needs no netem in the kernel).
One gloo rank per host (``GLOO_SOCKET_IFNAME`` = that host's end of the link), world size 2. Every
variant lives in the same two processes and is timed in rounds that alternate the variants (the
order reversed every other round), so load drift on the machine hits all of them alike. For each link
setting (every ``--rates`` x every ``--delay-ms``) the driver changes the link between phases; the
processes, models and batches stay. On the TUN link the driver also reads the wire's counters around
each phase: its packets, drops, how late packets left, and its CPU time.

Variants (one training step each: forward, backward with the exchange, optimizer step):
  * DDP on the plain fp32 LLaMA (``--model``, AdamW), gradients exchanged as ``trainer.grad_comm``
    says, through the hooks ``FP4DDPStrategy`` installs (``fp4lightning.distributed.comm.register_hook``
    with a default ``CommState``; at W = 2 ``fp8-e4m3`` is the async all-gather hook):
    ``fp32``, ``bf16``, ``fp8-e4m3``; ``none`` is the same step under ``no_sync`` (compute alone).
  * FSDP2 (``fully_shard_fp4``) on the same LLaMA with its linear layers converted to FP4Linear
    (``paper`` preset), bf16 parameters, fp32 gradient reduce-scatter: ``fsdp-bf16`` gathers the
    bf16 weights, ``fsdp-fp4`` gathers packed FP4 codes + row scales (embedding, norms and the head
    are gathered in bf16 by both).

Bytes on the wire are measured, not computed: each host reads its link's ``tx_bytes`` / ``rx_bytes``
(``/sys/class/net/DEV/statistics``, inside its namespace) after a barrier before and after every timed
step, so they are frames (Ethernet on the veth, bare IP packets on the TUN link): TCP/IP headers,
ACKs and gloo's own messages included. For FSDP the counters are also read after the forward, whose
traffic is the weight all-gathers alone.

    sudo .venv/bin/python benchmarks/bench_comm_hosts.py --rates 1gbit,10gbit
    sudo .venv/bin/python benchmarks/bench_comm_hosts.py --rates 1gbit --link tun --delay-ms 0,1 \\
        --variants fp32,bf16,fp8-e4m3,none --steps 4     # the same wire without and with 1 ms each way
    sudo .venv/bin/python benchmarks/bench_comm_hosts.py --rates 0.5gbit,1gbit,2gbit,5gbit,10gbit,25gbit \\
        --steps 3 --variants fp32,bf16,fp8-e4m3          # where FP8 stops paying
    sudo .venv/bin/python benchmarks/bench_comm_hosts.py --variants allreduce-fp32,allgather-u8,allgather-u8-x5
    .venv/bin/python benchmarks/bench_comm_hosts.py --loopback  # no namespaces: one machine's loopback
    sudo .venv/bin/python benchmarks/bench_comm_hosts.py --pin   # each host on its own CPU(s)

Both hosts share this machine's CPUs. By default every process may run anywhere; ``--pin`` gives each rank
(its threads, gloo's included) its own ``--threads`` CPUs, as two machines would have. The kernel's
network work (TCP, the veth, the ``tbf``) and the TUN wire run on whichever CPU the kernel picks.

The third line times bare gloo collectives of the model's size between the hosts (``COLLECTIVES``).

Needs root and ``ip netns`` (else it says so and exits 2); ``--loopback`` runs the same two ranks on
127.0.0.1 without a link limit (bytes from ``lo``'s counters, which count every process's traffic).
"""

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from fp4lightning.distributed.comm import CommState, register_hook, ring_all_reduce_bytes  # noqa: E402
from fp4lightning.models.llama import Llama, llama_config  # noqa: E402
from fp4lightning.train.recipe import WIRE_FORMAT  # noqa: E402

# name -> (config overrides on the "tiny" preset, batch, sequence length); "mid" is 29.5M parameters
MODELS = {
    "tiny": ({}, 1, 32),
    "mid": ({"dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376}, 1, 64),
}
DDP_VARIANTS = ("fp32", "bf16", "fp8-e4m3", "none")
FSDP_VARIANTS = ("fsdp-bf16", "fsdp-fp4")
VARIANTS = DDP_VARIANTS + FSDP_VARIANTS
#: bare gloo collectives on a buffer of the model's parameter count (no training): what the link and gloo
#: give each exchange's bytes; ``allgather-u8-x5`` is the same all-gather as five concurrent async pieces
COLLECTIVES = ("allreduce-fp32", "allreduce-bf16", "allgather-u8", "allgather-u8-x5")


# ---------------------------------------------------------------------------------------------
# one rank: the variants, stepped and measured


def wire_counters(dev: str) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of network device ``dev`` as this process's namespace sees it."""
    base = f"/sys/class/net/{dev}/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def _batches(cfg, batch: int, seq: int, n: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)  # the same batches for every variant
    return torch.randint(0, cfg.vocab_size, (n, batch, seq + 1), generator=gen)


class _TimedRegistration:
    """Stands for ``run.ddp`` in ``register_hook``: registers the hook it chose wrapped by ``run._timed``."""

    def __init__(self, run):
        self.run = run

    def register_comm_hook(self, state, hook) -> None:
        self.run.ddp.register_comm_hook(state, self.run._timed(hook))


class DDPRun:
    """One DDP replica with ``trainer.grad_comm`` = ``fmt``'s hook (``none``: no exchange, ``no_sync``)."""

    def __init__(self, model: str, fmt: str, world: int):
        overrides, self.batch, self.seq = MODELS[model]
        self.cfg = llama_config("tiny", max_seq_len=self.seq, **overrides)
        torch.manual_seed(0)
        self.model = Llama(self.cfg)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        self.fmt, self.state = fmt, None
        self.buckets: list = []  # this step's (bucket bytes, issued, done), seconds after backward began
        if fmt != "none":
            wire = WIRE_FORMAT[fmt]
            self.state = CommState(grad_format=wire)  # what FP4DDPStrategy(grad_format=wire) holds
            register_hook(_TimedRegistration(self), self.state, wire, world)  # the Trainer's hook, timed per bucket
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def _timed(self, hook):
        """``hook`` that also records, per bucket, the bytes it sends, when it was issued and when it was done."""
        def timed(state, bucket):
            issued, before = time.perf_counter(), state.total_bytes
            fut = hook(state, bucket)
            sent = state.total_bytes - before  # what the hook counts this rank sending for the bucket

            def done(f):
                self.buckets.append((sent, issued - self.t_backward, time.perf_counter() - self.t_backward))
                return f.value()
            return fut.then(done)
        return timed

    def step(self, x: torch.Tensor, y: torch.Tensor, mark) -> int:
        """One training step; returns the bytes the hooks counted as sent by this rank."""
        self.buckets = []
        with self.ddp.no_sync() if self.fmt == "none" else contextlib.nullcontext():
            logits = self.ddp(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            mark("fwd")
            self.t_backward = time.perf_counter()
            loss.backward()
            self.backward_s = time.perf_counter() - self.t_backward
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.state.pop_step()[0] if self.state else 0


class FSDPRun:
    """FSDP2 over the FP4Linear model: bf16 weight all-gather (``fsdp-bf16``) or FP4 (``fsdp-fp4``)."""

    def __init__(self, model: str, fmt: str, world: int):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from fp4lightning.distributed.fsdp import fully_shard_fp4
        from fp4lightning.nn.convert import convert_to_fp4

        overrides, self.batch, self.seq = MODELS[model]
        self.cfg = llama_config("tiny", max_seq_len=self.seq, **overrides)
        torch.manual_seed(0)
        self.model = convert_to_fp4(Llama(self.cfg), "paper")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard_fp4(self.model, fp4_all_gather=fmt == "fsdp-fp4", mp_policy=mp)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        # before FSDP2's own pre-forward of the first block: the root unit (embedding, final norm, head)
        # has been gathered, the blocks not yet
        self._mark = None
        self.model.layers[0].register_forward_pre_hook(self._root_gathered, prepend=True)

    def _root_gathered(self, module, args) -> None:
        self._mark("root")

    def step(self, x: torch.Tensor, y: torch.Tensor, mark) -> int:
        self._mark = mark
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        mark("fwd")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        st = self.model.fp4_gather_stats
        counted = st.fp4_bytes
        st.reset()
        return counted


class CollectiveRun:
    """One of :data:`COLLECTIVES` per step, on a buffer with as many elements as the model has parameters."""

    def __init__(self, model: str, kind: str, world: int):
        overrides, self.batch, self.seq = MODELS[model]
        self.cfg = llama_config("tiny", max_seq_len=self.seq, **overrides)
        with torch.device("meta"):
            self.model = Llama(self.cfg)
        n = sum(p.numel() for p in self.model.parameters())
        self.kind, self.world = kind, world
        dtype = {"allreduce-fp32": torch.float32, "allreduce-bf16": torch.bfloat16}.get(kind, torch.uint8)
        self.buf = torch.ones(n, dtype=dtype)
        self.out = torch.empty(world * n, dtype=dtype) if kind.startswith("allgather") else None

    def step(self, x: torch.Tensor, y: torch.Tensor, mark) -> int:
        mark("fwd")
        if self.kind.startswith("allreduce"):
            dist.all_reduce(self.buf)
        elif self.kind == "allgather-u8":
            dist.all_gather_into_tensor(self.out, self.buf)
        else:  # the same bytes in 5 pieces in flight at once (rank-major within each piece)
            outs = self.out.chunk(5)
            works = [dist.all_gather_into_tensor(o, b, async_op=True) for o, b in zip(outs, self.buf.chunk(5))]
            for w in works:
                w.wait()
        n, size = self.buf.numel(), self.buf.element_size()
        return ring_all_reduce_bytes(n, size, self.world) if self.kind.startswith("allreduce") else (self.world - 1) * n


def measured_step(run, x, y, dev: str) -> dict:
    """One step of ``run`` between barriers: seconds, this host's link tx/rx bytes for the whole step
    and up to the end of the forward, and the bytes the code counted."""
    marks = {}
    dist.barrier()
    c0 = wire_counters(dev)
    t0 = time.perf_counter()
    counted = run.step(x, y, lambda name: marks.setdefault(name, wire_counters(dev)))
    seconds = time.perf_counter() - t0
    dist.barrier()  # the peer's last bytes have arrived: a barrier travels behind them
    c1 = wire_counters(dev)
    out = {"s": seconds, "tx": c1[0] - c0[0], "rx": c1[1] - c0[1], "fwd_rx": marks["fwd"][1] - c0[1],
           "root_rx": marks["root"][1] - c0[1] if "root" in marks else 0, "counted": counted}
    if isinstance(run, DDPRun):
        out["backward_s"], out["buckets"] = run.backward_s, sorted(run.buckets, key=lambda b: b[1])
    return out


def _make_run(model: str, variant: str, world: int):
    cls = FSDPRun if variant in FSDP_VARIANTS else CollectiveRun if variant in COLLECTIVES else DDPRun
    return cls(model, variant, world)


def run_phase(runs: dict, tokens: torch.Tensor, steps: int, warmup: int, dev: str) -> dict:
    """``warmup + steps`` rounds over every variant (order reversed every other round); the timed
    rounds' measurements per variant."""
    out: dict = {v: [] for v in runs}
    order = list(runs)
    for i in range(warmup + steps):
        for v in order if i % 2 == 0 else order[::-1]:
            x, y = tokens[i % len(tokens), :, :-1], tokens[i % len(tokens), :, 1:]
            m = measured_step(runs[v], x, y, dev)
            if i >= warmup:
                out[v].append(m)
    return out


def _wait_for_link(sync_dir: str, phase: int) -> None:
    """Rank 0 tells the driver it is between phases and waits until the driver has set the link."""
    open(os.path.join(sync_dir, f"ready-{phase}"), "w").close()
    go = os.path.join(sync_dir, f"go-{phase}")
    while not os.path.exists(go):
        time.sleep(0.05)


def pinned_cpus(rank: int, threads: int) -> "set[int]":
    """``--pin``: rank r's CPUs, ``threads`` of them, host 0 on the lowest; refuses when the machine has too few."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 * threads:
        raise SystemExit(f"--pin needs {2 * threads} CPUs ({threads} per host), this process may use {len(cpus)}")
    return set(cpus[rank * threads:(rank + 1) * threads])


def worker(rank: int, world: int, args) -> None:
    """One rank: build every variant, then per phase (link setting) measure them; rank 0 writes JSON."""
    if args.pin:  # before any thread starts (gloo's, OpenMP's): they inherit the mask
        os.sched_setaffinity(0, pinned_cpus(rank, args.threads))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.nice_compute:  # this thread only (Linux nice is per thread): gloo's threads keep nice 0
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice_compute)
    variants = args.variants.split(",")
    runs = {v: _make_run(args.model, v, world) for v in variants}
    first = runs[variants[0]]
    tokens = _batches(first.cfg, first.batch, first.seq, max(args.steps + args.warmup, 1), rank)
    numel = sum(p.numel() for p in first.model.parameters())
    cpus = [None] * world  # the CPUs each rank may run on (--pin: its own)
    dist.all_gather_object(cpus, sorted(os.sched_getaffinity(0)))
    nice = [None] * world  # each rank's training thread's nice value (--nice-compute)
    dist.all_gather_object(nice, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    results = []
    for phase in range(args.phases):
        if rank == 0 and args.sync_dir:
            _wait_for_link(args.sync_dir, phase)
        dist.barrier()
        mine = run_phase(runs, tokens, args.steps, args.warmup, args.dev)
        both = [None] * world
        dist.all_gather_object(both, mine)
        results.append(both)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"numel": numel, "tokens": first.batch * first.seq, "cpus": cpus, "nice": nice,
                       "phases": results}, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the driver: two hosts (or loopback), the link per phase, the tables


def set_rate(hosts_, rate: str, burst_ms: float = 1.0) -> int:
    """Change the tbf rate of both ends of the link (``benchmarks/hosts.py`` puts tbf at the root, handle
    1:, with a burst of 1 ms of the rate); the burst is ``burst_ms`` of the rate (``hosts.tbf_burst``)."""
    import hosts

    burst = hosts.tbf_burst(rate, burst_ms)
    for i in (0, 1):
        cmd = ["ip", "netns", "exec", hosts_.ns(i), "tc", "qdisc", "change", "dev", hosts_.ifname, "root",
               "handle", "1:", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[4:])}` failed: {proc.stderr.strip()}")
    return burst


def _worker_cmd(rank: int, dev: str, phases: int, sync_dir: str, out: str, args) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank), "--dev", dev,
            "--model", args.model, "--variants", args.variants, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads", str(args.threads), "--phases", str(phases),
            "--sync-dir", sync_dir, "--out", out] + (["--pin"] if args.pin else []) + \
        (["--seq", str(args.seq)] if args.seq else []) + \
        (["--nice-compute", str(args.nice_compute)] if args.nice_compute else [])


def _worker_env(master: str, port: int, dev: str, threads: int) -> dict:
    env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=dev,
               OMP_NUM_THREADS=str(threads), WORLD_SIZE="2")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fp4lightning-inductor"))
    return env


def _drive_phases(procs, sync_dir: str, set_link, phases: list) -> None:
    """Per phase: wait for rank 0 to be between phases, set the link, let it go; then wait for the ranks."""
    for k, phase in enumerate(phases):
        ready = os.path.join(sync_dir, f"ready-{k}")
        while not os.path.exists(ready):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a rank exited before phase {k} (exit codes {[p.poll() for p in procs]})")
            time.sleep(0.05)
        set_link(phase)
        open(os.path.join(sync_dir, f"go-{k}"), "w").close()
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a rank failed (exit codes {[q.wait() for q in procs]})")


def wire_delta(before: dict, after: dict) -> dict:
    """What the wire did between two of its ``TwoHosts.wire_stats()`` readings."""
    d = {k: after[k] - before[k] for k in ("dropped", "write_errors", "late_ms_sum", "cpu_user_s", "cpu_sys_s", "wall_s")}
    d["packets"], d["bytes"] = sum(after["packets"]) - sum(before["packets"]), sum(after["bytes"]) - sum(before["bytes"])
    d["sched"] = after["sched"]
    return d


def run_hosts(args, phases: list) -> dict:
    """Both ranks, one per host, every phase ((rate, one-way delay ms) each); the JSON rank 0 wrote, with
    the wire's use per phase (``wire``) on the TUN link."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hosts

    reason = hosts.unavailable_reason(args.link)
    if reason:
        print(f"bench_comm_hosts: {reason} (or run --loopback)", file=sys.stderr)
        raise SystemExit(2)
    snaps, bursts = [], []

    def set_link(h, phase) -> None:
        bursts.append(set_rate(h, phase[0], args.burst_ms))
        if h.link == "tun":
            h.set_delay(phase[1])
            snaps.append(h.wire_stats())

    try:
        with tempfile.TemporaryDirectory() as sync_dir, \
                hosts.TwoHosts(rate=phases[0][0], delay_ms=phases[0][1], link=args.link) as h:
            out = os.path.join(sync_dir, "result.json")
            procs = [h.popen(i, _worker_cmd(i, h.ifname, len(phases), sync_dir, out, args),
                             env=_worker_env(h.addr(0), 29500, h.ifname, args.threads)) for i in (0, 1)]
            _drive_phases(procs, sync_dir, lambda phase: set_link(h, phase), phases)
            if snaps:
                snaps.append(h.wire_stats())
            with open(out) as f:
                result = json.load(f)
    except hosts.HostsUnavailable as e:  # e.g. a delay on a veth, on a kernel without netem
        print(f"bench_comm_hosts: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if snaps:
        result["wire"] = [wire_delta(a, b) for a, b in zip(snaps, snaps[1:])]
    result["tbf_burst_bytes"] = bursts  # per phase, both ends
    return result


def run_loopback(args) -> dict:
    """Both ranks on this machine's loopback, one phase, no link limit."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as sync_dir:
        out = os.path.join(sync_dir, "result.json")
        procs = [subprocess.Popen(_worker_cmd(i, "lo", 1, sync_dir, out, args),
                                  env=_worker_env("127.0.0.1", port, "lo", args.threads)) for i in (0, 1)]
        _drive_phases(procs, sync_dir, lambda rate: None, ["loopback"])
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------------
# tables


def combine(phase: list, variant: str) -> list[dict]:
    """Per timed step of ``variant``, both hosts together: the slower host's seconds (the step is done
    when both are), the mean over the hosts of the bytes each sent (tx) and received in the forward."""
    out = []
    for a, b in zip(phase[0][variant], phase[1][variant]):
        m = {k: (a[k] + b[k]) / 2 for k in ("tx", "fwd_rx", "root_rx")}
        out.append({**m, "s": max(a["s"], b["s"]), "blocks_rx": m["fwd_rx"] - m["root_rx"], "counted": a["counted"]})
    return out


def paired_ratio(steps: dict, v: str, ref: str, key: str) -> float:
    """Median over the rounds of ``v``'s value over ``ref``'s in the same round."""
    return statistics.median(a[key] / b[key] for a, b in zip(steps[v], steps[ref]) if b[key])


def exchange_ratio(steps: dict, v: str, ref: str) -> float:
    """Median over the rounds of what the exchange adds to a step, ``v`` over ``ref``: each step minus the
    same round's ``none`` step (no exchange)."""
    return statistics.median((a["s"] - n["s"]) / (b["s"] - n["s"])
                             for a, b, n in zip(steps[v], steps[ref], steps["none"]) if b["s"] > n["s"])


#: the side-by-side ratios: (variant, reference, measurement, column name)
RATIOS = (
    ("fp8-e4m3", "fp32", "s", "fp8/fp32 time"),
    ("fp8-e4m3", "bf16", "s", "fp8/bf16 time"),
    ("bf16", "fp32", "s", "bf16/fp32 time"),
    ("fp8-e4m3", "fp32", "tx", "fp8/fp32 bytes"),
    ("fp8-e4m3", "bf16", "tx", "fp8/bf16 bytes"),
    ("fsdp-fp4", "fsdp-bf16", "s", "fsdp fp4/bf16 time"),
    ("fsdp-fp4", "fsdp-bf16", "fwd_rx", "fp4/bf16 gather bytes"),
    ("fsdp-fp4", "fsdp-bf16", "blocks_rx", "fp4/bf16 block gather bytes"),
    ("fsdp-fp4", "fsdp-bf16", "tx", "fsdp fp4/bf16 step bytes"),
)


def phase_label(phase, link: str) -> str:
    """``1gbit``, or ``1gbit +1 ms`` (one-way delay) on the TUN link or with a delay."""
    rate, delay = phase
    return rate if link != "tun" and not delay else f"{rate} +{delay:g} ms"


def summarize(result: dict, phases: list, link: str = "veth") -> list[dict]:
    """One row per link setting: median step times and the paired ratios the issue's targets name."""
    rows = []
    for (rate, delay), phase in zip(phases, result["phases"]):
        steps = {v: combine(phase, v) for v in phase[0]}
        row = {"rate": rate, "delay_ms": delay, "link": link, "label": phase_label((rate, delay), link),
               **{f"{v} ms": statistics.median(m["s"] for m in s) * 1e3 for v, s in steps.items()}}
        row.update({f"{v} MB": statistics.median(m["tx"] for m in s) / 1e6 for v, s in steps.items()})
        for v, ref, key, name in RATIOS:
            if v in steps and ref in steps:
                row[name] = paired_ratio(steps, v, ref, key)
        for v, ref in (("fp8-e4m3", "fp32"), ("fp8-e4m3", "bf16")):
            if {v, ref, "none"} <= set(steps):
                row[f"{v[:3]}/{ref} exchange"] = exchange_ratio(steps, v, ref)
        rows.append(row)
    return rows


def _print_phase(label: str, phase: list, wire: "dict | None") -> None:
    steps = {v: combine(phase, v) for v in phase[0]}
    print(f"\n### link {label}\n")
    print("| variant | step ms min / median / max | MB sent per host per step (link tx) "
          "| MB received in the forward (all-gathers): all / the blocks' | counted by the code (MB) |")
    print("|---|---|---|---|---|")
    for v, s in steps.items():
        ms = sorted(m["s"] * 1e3 for m in s)
        med = {k: statistics.median(m[k] for m in s) / 1e6 for k in ("tx", "fwd_rx", "blocks_rx")}
        print(f"| {v} | {ms[0]:.0f} / {statistics.median(ms):.0f} / {ms[-1]:.0f} | {med['tx']:.2f} "
              f"| {med['fwd_rx']:.2f} / {med['blocks_rx']:.2f} | {s[-1]['counted'] / 1e6:.2f} |")
    if wire:
        cpu = wire["cpu_user_s"] + wire["cpu_sys_s"]
        print(f"\nThe wire over this phase: {wire['packets']} packets, {wire['bytes'] / 1e6:.1f} MB (both directions), "
              f"{wire['dropped']} dropped; a packet left {wire['late_ms_sum'] * 1e3 / max(wire['packets'], 1):.0f} us "
              f"after its due time on average; CPU {wire['cpu_user_s']:.2f} s user + {wire['cpu_sys_s']:.2f} s system "
              f"in {wire['wall_s']:.1f} s ({100 * cpu / wire['wall_s']:.0f}% of one core; scheduling: {wire['sched']})")


def timeline(steps: list[dict]) -> "dict | None":
    """Medians over a DDP variant's timed steps of when its exchange ran, in ms after backward began: the
    first and the last bucket issued (the last marks the end of the backward's compute), the last one
    done, and the rate the buckets moved at (this host's bytes per second): those done before the last
    was issued, from the first issued to the last of them done, and those done after, from then to the
    last done; None without buckets (``none``)."""
    rows = [m for m in steps if m.get("buckets")]
    if not rows:
        return None

    def rate(m, during):
        """MB/s of the buckets done before the last one was issued (during), or after it (after)."""
        end = m["buckets"][-1][1]  # the last bucket issued: backward's compute is over
        chosen = [b for b in m["buckets"] if (b[2] <= end) == during]
        if not chosen:
            return None
        t0 = min(b[1] for b in chosen) if during else end
        return sum(b[0] for b in chosen) / 1e6 / max(max(b[2] for b in chosen) - t0, 1e-9)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    return {"backward_ms": med(m["backward_s"] * 1e3 for m in rows), "buckets": len(rows[0]["buckets"]),
            "first_issued_ms": med(m["buckets"][0][1] * 1e3 for m in rows),
            "last_issued_ms": med(m["buckets"][-1][1] * 1e3 for m in rows),
            "last_done_ms": med(max(b[2] for b in m["buckets"]) * 1e3 for m in rows),
            "mb_s_during_backward": med(rate(m, True) for m in rows),
            "mb_s_after_backward": med(rate(m, False) for m in rows)}


def _print_timeline(phase: list) -> None:
    rows = {v: timeline(phase[0][v]) for v in phase[0]}  # rank 0's steps
    rows = {v: r for v, r in rows.items() if r}
    if not rows:
        return
    print("\nExchange timeline (rank 0; ms after backward began, medians over the timed steps; MB/s: this "
          "host's bytes over the time its buckets were in flight):\n")
    print("| variant | buckets | backward ms | first bucket issued | last issued | last done "
          "| MB/s while backward computes | MB/s after |")
    print("|---|---|---|---|---|---|---|---|")

    def f(v):
        return "-" if v is None else f"{v:.0f}"
    for v, r in rows.items():
        print(f"| {v} | {r['buckets']} | {f(r['backward_ms'])} | {f(r['first_issued_ms'])} | {f(r['last_issued_ms'])} "
              f"| {f(r['last_done_ms'])} | {f(r['mb_s_during_backward'])} | {f(r['mb_s_after_backward'])} |")


def print_tables(result: dict, phases: list, args) -> list[dict]:
    overrides, batch, seq = MODELS[args.model]
    print(f"# bench_comm_hosts: 2 hosts x 1 gloo rank, {args.model} LLaMA ({result['numel'] / 1e6:.1f}M parameters, "
          f"batch {batch} x {seq}), {args.steps} timed rounds (+{args.warmup} warm-up) alternating the variants, "
          f"{args.threads} thread(s)/rank, "
          f"{f'training threads at nice {args.nice_compute}, ' if args.nice_compute else ''}"
          f"{f'tbf burst {args.burst_ms:g} ms of the rate, ' if args.burst_ms != 1.0 and not args.loopback else ''}"
          f"{'each host pinned to its own CPU(s) of ' if args.pin else ''}{os.cpu_count()} CPUs shared by both hosts, "
          f"torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}")
    wires = result.get("wire") or [None] * len(phases)
    for ph, phase, wire in zip(phases, result["phases"], wires):
        _print_phase(phase_label(ph, args.link), phase, wire)
        _print_timeline(phase)
    rows = summarize(result, phases, args.link)
    cols = [c for c in ("fp32 ms", "bf16 ms", "fp8-e4m3 ms", "none ms", "fsdp-bf16 ms", "fsdp-fp4 ms")
            if c in rows[0]] + [c for c in [r[3] for r in RATIOS] + ["fp8/fp32 exchange", "fp8/bf16 exchange"]
                                if c in rows[0]]
    if not cols:
        return rows
    print("\n### Side by side (ratios: median over rounds of the paired steps)\n")
    print("| link | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for row in rows:
        print(f"| {row['label']} | " + " | ".join(f"{row[c]:.0f}" if c.endswith("ms") else f"{row[c]:.3f}"
                                               for c in cols) + " |")
    return rows


#: the ratios ``--repeat`` summarizes across runs
ACROSS = ("fp8/fp32 time", "fp8/bf16 time", "bf16/fp32 time", "fp8/fp32 exchange", "fsdp fp4/bf16 time")


def across_runs(rows_per_run: "list[list[dict]]") -> "list[dict]":
    """Per link setting and ratio of :data:`ACROSS`: each run's value (fresh processes, a fresh link per run),
    their mean and the 95% t-interval of the mean (``fp4lightning.experiments.stats``)."""
    from fp4lightning.experiments.stats import paired_t

    out = []
    for i, first in enumerate(rows_per_run[0]):
        for col in ACROSS:
            if col not in first:
                continue
            values = [rows[i][col] for rows in rows_per_run]
            t = paired_t(values)
            out.append({"label": first["label"], "ratio": col, "values": values, "mean": t["mean"], "ci95": t["ci95"]})
    return out


def print_across_runs(rows_per_run: "list[list[dict]]") -> None:
    print(f"\n### Across the {len(rows_per_run)} runs (each run's median ratio; mean and 95% interval of the mean)\n")
    print("| link | ratio | per run | min / max | mean | 95% interval |")
    print("|---|---|---|---|---|---|")
    for r in across_runs(rows_per_run):
        lo, hi = r["ci95"] or (float("nan"), float("nan"))
        print(f"| {r['label']} | {r['ratio']} | {', '.join(f'{v:.3f}' for v in r['values'])} | "
              f"{min(r['values']):.3f} / {max(r['values']):.3f} | {r['mean']:.3f} | [{lo:.3f}, {hi:.3f}] |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,10gbit",
                   help="link rates, one phase each (tc spelling; default: 1gbit,10gbit)")
    p.add_argument("--delay-ms", default="0",
                   help="one-way link delays in ms, one phase each per rate, e.g. 0,1 (default: 0); above 0 the "
                        "TUN link's wire adds them unless --link veth (which needs netem)")
    p.add_argument("--link", choices=("veth", "tun"), default=None,
                   help="veth pair, or TUN devices joined by the harness's wire (default: tun with a delay, else veth)")
    p.add_argument("--model", default="mid", choices=sorted(MODELS), help="LLaMA size (default: mid, 29.5M)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list from {VARIANTS + COLLECTIVES} (default: {','.join(VARIANTS)})")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per step (one sequence; default: the model's, 64 for mid): less compute per step")
    p.add_argument("--steps", type=int, default=5, help="timed rounds per phase (default: 5)")
    p.add_argument("--nice-compute", type=int, default=0,
                   help="diagnosis: lower each rank's training thread (forward, backward, the hooks, the optimizer) "
                        "by this nice value (0-19), so that gloo's threads and the kernel's network work get the CPU "
                        "first when both want it (default: 0)")
    p.add_argument("--burst-ms", type=float, default=1.0,
                   help="diagnosis: the tbf's burst, in ms of the rate (default: 1; at least 64 KiB): how long the "
                        "link may fall behind (a sender that waited for the CPU) and catch up at the veth's speed")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything this many times, fresh processes and link each time, and summarize the "
                        "ratios across the runs (default: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first, per phase (default: 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    p.add_argument("--loopback", action="store_true", help="both ranks on 127.0.0.1, no namespaces, no link limit")
    p.add_argument("--pin", action="store_true",
                   help="give each host its own CPUs (--threads each; sched_setaffinity), as two separate machines "
                        "would have; by default both hosts' processes run on any of the machine's CPUs")
    p.add_argument("--json", help="also write the summary rows and raw measurements here")
    for hidden in ("--worker", "--rank", "--dev", "--phases", "--sync-dir", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS, **({"action": "store_true"} if hidden == "--worker" else {}))
    args = p.parse_args(argv)
    if not args.burst_ms > 0:
        p.error(f"--burst-ms: {args.burst_ms} is not a positive number of milliseconds")
    if not 0 <= args.nice_compute <= 19:
        p.error(f"--nice-compute: {args.nice_compute} is not a nice value from 0 to 19")
    if args.repeat < 1:
        p.error(f"--repeat: {args.repeat} is not a positive number of runs")
    if args.seq is not None:
        if args.seq < 1:
            p.error(f"--seq: {args.seq} is not a positive number of tokens")
        overrides, batch, _ = MODELS[args.model]
        MODELS[args.model] = (overrides, batch, args.seq)  # this process's, and each worker's (it gets --seq)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS + COLLECTIVES]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {VARIANTS + COLLECTIVES}")
    try:
        delays = [float(d) for d in args.delay_ms.split(",")]
    except ValueError:
        p.error(f"--delay-ms: {args.delay_ms!r} is not a comma list of milliseconds, e.g. 0,1")
    if any(d < 0 for d in delays):
        p.error(f"--delay-ms: {args.delay_ms!r} has a negative delay")
    if not args.loopback:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import hosts

        for rate in args.rates.split(","):
            try:
                hosts.tbf_burst(rate)
            except ValueError as e:
                p.error(f"--rates: {e}")
    args.link = args.link or ("tun" if any(delays) else "veth")
    if args.link == "veth" and len(set(delays)) > 1:
        p.error("--delay-ms: several delays need --link tun (a veth's netem delay is set once)")
    if args.worker:
        args.phases = int(args.phases)
        worker(int(args.rank), 2, args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # FSDP2 keeps gloo's threads alive past destroy_process_group (see tests/test_fsdp.py)
    if args.loopback:
        phases, args.link = [("loopback", 0.0)], "loopback"
    else:
        phases = [(rate, delay) for rate in args.rates.split(",") for delay in delays]
    runs = []
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"\n## run {k + 1} of {args.repeat}\n")
        result = run_loopback(args) if args.loopback else run_hosts(args, phases)
        runs.append({"rows": print_tables(result, phases, args), "raw": result})
    if args.repeat > 1:
        print_across_runs([r["rows"] for r in runs])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**runs[0], "runs": runs, "argv": sys.argv[1:]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
