"""Gradient communication at W ranks on gloo: FP8 hook against fp32 all-reduce and bf16 compression.

One run, one process group, the same model and batches for every format (arXiv 2501.17116, section 3.2):
  * fp32: PyTorch's ``allreduce_hook`` (what DDP does without a hook);
  * bf16: PyTorch's ``bf16_compress_hook``;
  * e4m3: ``fp4lightning.distributed.comm.fp8_compress_hook`` (amax MAX-reduce, all_to_all + all_gather of FP8 bytes;
    the default scheme at W > 2);
  * e4m3-async: ``fp4lightning.distributed.comm.fp8_async_gather_hook`` (one asynchronous all_gather of FP8 bytes plus
    the senders' scales per bucket, decoded in the future's callback while backward continues; the default
    scheme at W = 2);
  * none: ``DDP.no_sync()``, no communication at all, to separate the sync cost from compute.
Prints, per model (the project's LLaMA ``tiny`` and a mid-size one), bytes each rank sent per step
(counted by the hooks, see docs/distributed.md) and median time per training step (forward,
backward with gradient sync, AdamW step), both as ratios against fp32.

    .venv/bin/python benchmarks/bench_comm.py [--world 2] [--steps 10] [--models tiny,mid]
    .venv/bin/python benchmarks/bench_comm.py --network-model   # formulas only, no processes
    .venv/bin/python benchmarks/bench_comm.py --codec --models mid  # the FP8 hook's CPU per step, one process

``--codec`` times, in this process (no process group), the CPU the default W = 2 FP8 hook spends on one
step's buckets (the model's fp32 gradients in reverse parameter order, cut at DDP's default 25 MiB cap;
DDP's reducer may cut its first bucket elsewhere): the encode (amax, scales, FP8 codes:
``_own_scale_payload``) and the decode-and-mean of two ranks' payloads (``_sum_own_scale_payloads``), each
against a copy of the same fp32 bytes (``clone``, what reading and writing them once costs). Medians over
``--steps`` steps, ``--threads`` threads.

``--network-model`` prints the modelled time on the wire per rank (bytes / link bandwidth) for DDP
gradient sync and FSDP2 weight all-gather + gradient reduce-scatter, using the byte formulas the hooks
count (docs/distributed.md); it is arithmetic, not a measurement.
"""

import argparse
import contextlib
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4lightning.distributed.comm import CommState, hook_for_format  # noqa: E402
from fp4lightning.models.llama import Llama, llama_config  # noqa: E402

# name -> (config overrides on the "tiny" preset, batch, sequence length)
MODELS = {
    "tiny": ({}, 4, 64),
    "mid": ({"dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376}, 1, 64),
}
FORMATS = ("fp32", "bf16", "e4m3", "e4m3-async", "none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    """One DDP replica of the model with one sync format; ``step()`` trains one batch and times it."""

    def __init__(self, model_name: str, fmt: str, steps: int, rank: int):
        overrides, batch, seq = MODELS[model_name]
        self.cfg = llama_config("tiny", max_seq_len=seq, **overrides)
        torch.manual_seed(0)
        self.model = Llama(self.cfg)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        self.fmt, self.state = fmt, None
        if fmt != "none":
            # check_finite=False keeps the baselines exactly PyTorch's hooks (plus byte counting)
            grad_format, scheme = ("e4m3", "async_all_gather") if fmt == "e4m3-async" else (fmt, "reduce_scatter")
            self.state = CommState(grad_format=grad_format, scheme=scheme, check_finite=False)
            self.ddp.register_comm_hook(self.state, hook_for_format(grad_format, scheme))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1000 + rank)  # same batches for every format
        self.tokens = torch.randint(0, self.cfg.vocab_size, (steps, batch, seq + 1), generator=gen)
        self.times: list[float] = []
        self.bytes: list[int] = []

    def step(self, i: int, record: bool) -> None:
        x, y = self.tokens[i, :, :-1], self.tokens[i, :, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        with self.ddp.no_sync() if self.fmt == "none" else contextlib.nullcontext():
            logits = self.ddp(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        sent = self.state.pop_step()[0] if self.state else 0
        if record:
            self.times.append(elapsed)
            self.bytes.append(sent)


def _bench_model(model_name: str, steps: int, warmup: int, rank: int) -> dict:
    runs = {fmt: _Run(model_name, fmt, steps + warmup, rank) for fmt in FORMATS}
    # round-robin over formats so that load drift on a shared machine hits all of them alike
    for i in range(steps + warmup):
        for fmt in FORMATS:
            runs[fmt].step(i, record=i >= warmup)
    numel = sum(p.numel() for p in runs["fp32"].model.parameters())
    return {fmt: (statistics.median(r.times), r.bytes[-1], numel) for fmt, r in runs.items()}


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {sorted(MODELS)}")
        rows.append((name, _bench_model(name, args.steps, args.warmup, rank)))
    if rank == 0:
        _print_table(rows, world, args)
    dist.destroy_process_group()


def _print_table(rows, world: int, args) -> None:
    print(f"# bench_comm: W={world} gloo, {args.threads} thread(s)/rank, median of {args.steps} steps "
          f"({args.warmup} warm-up), torch {torch.__version__}, {datetime.date.today().isoformat()}")
    print("| model | params | sync | bytes sent / step / rank | bytes vs fp32 | step ms | step vs fp32 "
          "| sync ms (step - no-sync step) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in rows:
        t32, b32, numel = res["fp32"]
        t_none = res["none"][0]
        for fmt in FORMATS:
            t, b, _ = res[fmt]
            label = {"fp32": "fp32 all-reduce", "bf16": "bf16_compress_hook", "e4m3": "FP8 E4M3 reduce-scatter hook",
                     "e4m3-async": "FP8 E4M3 async all_gather hook (default at W = 2)",
                     "none": "no sync (no_sync)"}[fmt]
            print(f"| {name} | {numel / 1e6:.1f}M | {label} | {b:,} | {b / b32:.3f} | {t * 1e3:.1f} "
                  f"| {t / t32:.2f} | {(t - t_none) * 1e3:.1f} |")


# bytes one rank sends per step (N parameters, W ranks); see docs/distributed.md "Bytes on the wire"
def _ddp_bytes(n: float, w: int) -> dict:
    ring = 2 * n * (w - 1) / w
    return {"DDP fp32 all-reduce": 4 * ring, "DDP bf16 all-reduce": 2 * ring,
            "DDP FP8 reduce_scatter hook": ring, "DDP FP8 async_all_gather hook": n * (w - 1)}


def _fsdp_bytes(n: float, w: int) -> dict:
    part = n * (w - 1) / w  # all-gather / reduce-scatter volume per rank, per byte of element
    # weights gathered twice per micro-batch (forward, and again for backward after resharding)
    return {"FSDP2 bf16 gather x2 + fp32 RS": 2 * 2 * part + 4 * part,
            "FSDP2 FP4 gather x2 + fp32 RS": 2 * 0.5 * part + 4 * part,
            "FSDP2 FP4 gather x2 + FP8 RS": 2 * 0.5 * part + part}


def _network_model() -> None:
    print(f"# bench_comm --network-model ({datetime.date.today().isoformat()}): seconds on the wire per rank per "
          "sync = bytes / link; FP4 gather counts 0.5 byte/element (+4 bytes/row, negligible)")
    print("| model | W | scheme | GB per rank | 25 Gbit/s | 100 Gbit/s |")
    print("|---|---|---|---|---|---|")
    for name, n in (("mid 29.5M", 29.5e6), ("LLaMA-2 7B", 6.74e9), ("LLaMA-2 13B", 13.0e9)):
        for w in (2, 8):
            for scheme, b in {**_ddp_bytes(n, w), **_fsdp_bytes(n, w)}.items():
                print(f"| {name} | {w} | {scheme} | {b / 1e9:.3f} | {b * 8 / 25e9:.3f} | {b * 8 / 100e9:.3f} |")


def _buckets(model_name: str, cap_bytes: int = 25 * 2**20) -> list[list[int]]:
    """The model's gradient sizes in buckets: reverse parameter order, a bucket closed once it holds
    ``cap_bytes`` of fp32 (DDP's default cap)."""
    overrides, _, seq = MODELS[model_name]
    with torch.device("meta"):
        model = Llama(llama_config("tiny", max_seq_len=seq, **overrides))
    buckets, cur, size = [], [], 0
    for p in reversed(list(model.parameters())):
        cur.append(p.numel())
        size += 4 * p.numel()
        if size >= cap_bytes:
            buckets, cur, size = buckets + [cur], [], 0
    return buckets + ([cur] if cur else [])


def _codec(args) -> None:
    """``--codec``: the FP8 hook's CPU per step (see the module docstring)."""
    from fp4lightning.distributed.comm import _own_scale_payload, _sum_own_scale_payloads

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, {args.threads} thread(s)\n")
    print("| model | buckets | tensors | elements | encode ms | decode-and-mean ms (W = 2) | fp32 copy ms | "
          "encode / copy | decode / copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        sizes = _buckets(name)
        bufs = [torch.randn(sum(b), generator=gen) * 1e-3 for b in sizes]
        times: dict[str, list[float]] = {"enc": [], "dec": [], "copy": []}
        for step in range(args.warmup + args.steps):
            t = {"enc": 0.0, "dec": 0.0, "copy": 0.0}
            for buf, b in zip(bufs, sizes):
                t0 = time.perf_counter()
                payload = _own_scale_payload(buf, b, "e4m3")
                t1 = time.perf_counter()
                gathered = torch.stack([payload, payload])  # what the all-gather returns at W = 2
                t2 = time.perf_counter()
                _sum_own_scale_payloads(gathered, buf, b, "e4m3")
                t3 = time.perf_counter()
                buf.clone()
                t4 = time.perf_counter()
                t["enc"], t["dec"], t["copy"] = t["enc"] + t1 - t0, t["dec"] + t3 - t2, t["copy"] + t4 - t3
            if step >= args.warmup:
                for k in t:
                    times[k].append(1e3 * t[k])
        enc, dec, copy = (statistics.median(times[k]) for k in ("enc", "dec", "copy"))
        print(f"| {name} | {len(sizes)} | {sum(map(len, sizes))} | {sum(map(sum, sizes)) / 1e6:.1f}M | {enc:.1f} | "
              f"{dec:.1f} | {copy:.1f} | {enc / copy:.2f} | {dec / copy:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="number of gloo ranks (type: int, default: 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per format (type: int, default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (type: int, default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (type: int, default: 1)")
    p.add_argument("--models", default="tiny,mid", help=f"comma list from {sorted(MODELS)} (default: tiny,mid)")
    p.add_argument("--network-model", action="store_true", help="print the bytes/bandwidth model and exit")
    p.add_argument("--codec", action="store_true", help="time the FP8 hook's encode and decode per step and exit")
    args = p.parse_args()
    if args.network_model:
        return _network_model()
    if args.codec:
        return _codec(args)
    mp.spawn(_worker, args=(args.world, _free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
