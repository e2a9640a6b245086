"""What one decoder block saves for its backward: nn.Linear against FP4Linear, eager and compiled (issue 47).

The llama2-1.3b step on the H200 peaked 2.0 GB (``w4a4-direct``) and 5.1 GB (``paper``) above
bf16-mixed with its blocks compiled (docs/perf.md), although each FP4 layer holds a quarter of what
``nn.Linear`` holds (``roofline.py``'s memory columns). This script measures the whole block: every
tensor autograd saves during one forward of a LLaMA decoder block under bf16 autocast (a
``saved_tensors_hooks`` pack hook; distinct buffers, the block's parameters and its input not counted),
at two token counts, so the saving splits into a part per token (activations) and a fixed part (per
weight: autocast's bf16 copies, the FP4 codes). From these it projects a training step's difference
against bf16 in the same mode: ``blocks x (tokens x per-token difference + fixed difference)``.

Every (layer, mode) runs in its own block built from one seed; compiled blocks go through
``torch.compile`` as training compiles them (``trainer.compile``: the blocks), each FP4 layer a graph
break. On a machine without a GPU the FP4 layers run their CPU path, whose saved tensors are the CUDA
path's but for ``paper``'s residual (CSR on CPU, a fixed-capacity compact list on CUDA).

    python benchmarks/bench_block_memory.py                                   # llama2-1.3b block, CPU
    python benchmarks/bench_block_memory.py --model tiny --modes eager --json /tmp/mem.json
    python benchmarks/bench_block_memory.py --modes compiled --memory-budget 0.5  # the partitioner recomputes more
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS = ("bf16", "w4a4-direct", "paper")
MODES = ("eager", "compiled")


def _build(model: str, layer: str, mode: str, device: torch.device):
    from fp4lightning.models.config import LLAMA_CONFIGS
    from fp4lightning.models.llama import Block
    from fp4lightning.nn.convert import convert_to_fp4

    cfg = LLAMA_CONFIGS[model]
    torch.manual_seed(0)
    block = Block(cfg).to(device)
    if layer != "bf16":
        convert_to_fp4(block, layer)
    return cfg, (torch.compile(block) if mode == "compiled" else block)


def saved_bytes(block, cfg, tokens: int, device: torch.device, budget: float | None = None) -> tuple[int, int]:
    """(bytes, buffers) autograd saves in one forward of ``block`` at ``tokens`` tokens (second call);
    ``budget``: the compiler partitioner's ``activation_memory_budget`` while it compiles (None: torch's)."""
    from fp4lightning.models.llama import rope_cos_sin

    x = torch.randn(1, tokens, cfg.dim, device=device, requires_grad=True)
    cos, sin = rope_cos_sin(tokens, cfg.dim // cfg.n_heads, 10000.0, device)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    out = (0, 0)
    for _ in range(2):  # the first call compiles; the second is measured
        saved: dict[int, int] = {}

        def pack(t):
            parts = (t.crow_indices(), t.col_indices(), t.values()) if t.layout == torch.sparse_csr else (t,)
            for p in parts:
                if p.untyped_storage().data_ptr() not in skip:
                    saved[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
            return t

        patch = (torch._functorch.config.patch(activation_memory_budget=budget) if budget is not None
                 else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(device.type, dtype=torch.bfloat16), patch:
            y = block(x, cos, sin)
        y.float().sum().backward()
        out = (sum(saved.values()), len(saved))
    return out


def measure(model: str, layers, modes, tokens: tuple[int, int], device: torch.device,
            budget: float | None = None) -> dict:
    """``{mode: {layer: {"per_token_kb", "fixed_mb", "saved_mb": [at tokens[0], at tokens[1]]}}}``."""
    out: dict = {}
    for mode in modes:
        for layer in layers:
            torch._dynamo.reset()
            cfg, block = _build(model, layer, mode, device)
            (b0, _), (b1, _) = (saved_bytes(block, cfg, t, device, budget if mode == "compiled" else None)
                                for t in tokens)
            per_token = (b1 - b0) / (tokens[1] - tokens[0])
            out.setdefault(mode, {})[layer] = {"per_token_kb": round(per_token / 1e3, 2),
                                               "fixed_mb": round((b0 - per_token * tokens[0]) / 1e6, 2),
                                               "saved_mb": [round(b0 / 1e6, 2), round(b1 / 1e6, 2)]}
            print(f"| {mode} | {layer} | {per_token / 1e3:.1f} | {(b0 - per_token * tokens[0]) / 1e6:.1f} |",
                  flush=True)
    return out


def project(result: dict, blocks: int, step_tokens: int) -> dict:
    """Per mode and FP4 layer, a training step's saved-memory difference against bf16 (GB)."""
    out = {}
    for mode, row in result.items():
        base = row.get("bf16")
        if base is None:
            continue
        for layer, r in row.items():
            if layer != "bf16":
                d = blocks * (step_tokens * (r["per_token_kb"] - base["per_token_kb"]) * 1e3
                              + (r["fixed_mb"] - base["fixed_mb"]) * 1e6)
                out.setdefault(mode, {})[layer] = round(d / 1e9, 2)
    return out


def main(argv=None) -> int:
    from fp4lightning.models.config import LLAMA_CONFIGS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama2-1.3b", choices=sorted(LLAMA_CONFIGS), help="the block's config")
    p.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--tokens", default="256,512", help="the two token counts (default 256,512)")
    p.add_argument("--step-tokens", type=int, default=32768,
                   help="tokens of the projected training step (default 32768: the H200 1.3B step's 16 x 2048)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="compiled rows: the partitioner's activation_memory_budget (0-1; lower saves less and "
                        "recomputes more; default: torch's, 1.0)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    layers, modes = args.layers.split(","), args.modes.split(",")
    bad = [x for x in layers if x not in LAYERS] + [x for x in modes if x not in MODES]
    if bad:
        p.error(f"unknown layer or mode {bad}: layers are {', '.join(LAYERS)}; modes {', '.join(MODES)}")
    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        tokens = ()
    if len(tokens) != 2 or not 0 < tokens[0] < tokens[1]:
        p.error(f"--tokens {args.tokens!r}: give two increasing token counts, such as 256,512")
    if args.memory_budget is not None and not 0.0 <= args.memory_budget <= 1.0:
        p.error(f"--memory-budget {args.memory_budget}: give a fraction from 0 to 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"# one {args.model} block, bf16 autocast, {device.type}: what autograd saves\n"
          "| mode | layer | kB per token | fixed MB |\n|---|---|---|---|", flush=True)
    result = measure(args.model, layers, modes, tokens, device, args.memory_budget)
    blocks = LLAMA_CONFIGS[args.model].n_layers
    proj = project(result, blocks, args.step_tokens)
    for mode, row in proj.items():
        for layer, gb in row.items():
            print(f"{mode}: {layer} saves {gb:+.2f} GB against bf16 over {blocks} blocks at {args.step_tokens} tokens")
    if args.json:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "model": args.model, "device": device.type, "torch": torch.__version__, "tokens": list(tokens),
                  "threads": torch.get_num_threads(), "blocks": blocks, "step_tokens": args.step_tokens,
                  "memory_budget": args.memory_budget, "saved": result, "step_difference_gb": proj}
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
