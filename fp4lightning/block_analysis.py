"""Quantization fidelity of every FP4 format on a model's real tensors, measured in one run.

For the inputs of every linear layer FP4 would quantize (captured as in
``fp4lightning.fidelity``) and for the weights of those layers, this scores each format's
quantize-dequantize by its SQNR in dB (signal energy over error energy, pooled over
layers):

* the paper's per-token / per-channel E2M1 (arXiv 2501.17116, section 3.1), with and
  without OCC (alpha 0.99, compensated; section 3.3);
* NVFP4 and MXFP4 with blocks along K, as the forward GeMM quantizes A and W;
* NVFP4 and MXFP4 with blocks along the tokens, as the wgrad GeMM quantizes A, with and
  without the 16-point random Hadamard transform (the transform is orthogonal, so the
  error is measured in the rotated basis without changing its energy);
* NVFP4 with 16 x 16 weight tiles.

``python -m fp4lightning.block_analysis CHECKPOINT DATA_DIR [--seq-len N]`` prints the
Markdown table; ``fp4lightning compare`` appends it to its report.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .block_formats import fake_quantize_block
from .hadamard import apply_rht, rht_matrix
from .occ import occ_bounds, occ_clamp
from .quantize import fake_quantize

__all__ = ["ACT_FORMATS", "WEIGHT_FORMATS", "block_fidelity_report", "format_block_table", "checkpoint_report"]


def _fq(x: torch.Tensor, fmt: str, block_2d: bool = False) -> torch.Tensor:
    v, factor, _ = fake_quantize_block(x, fmt, block_2d=block_2d)
    return v * factor


def _occ_paper(x: torch.Tensor) -> torch.Tensor:
    xc, r = occ_clamp(x, occ_bounds(x, 0.99, "exact"))
    return fake_quantize(xc, "per_token", "float") + r


def _tokens(fmt: str, rht: bool):
    def run(x: torch.Tensor):
        ref = apply_rht(x, rht_matrix(0, device=x.device), 0) if rht else x
        return ref, _fq(ref.t().contiguous(), fmt).t()
    return run


#: (label, fn(x) -> (reference, quantized)) for activations (tokens x K)
ACT_FORMATS = (
    ("paper: E2M1 per token", lambda x: (x, fake_quantize(x, "per_token", "float"))),
    ("paper: E2M1 per token + OCC (alpha 0.99, comp.)", lambda x: (x, _occ_paper(x))),
    ("NVFP4, 16 along K (fprop)", lambda x: (x, _fq(x, "nvfp4"))),
    ("MXFP4, 32 along K (fprop)", lambda x: (x, _fq(x, "mxfp4"))),
    ("NVFP4, 16 along tokens (wgrad)", _tokens("nvfp4", False)),
    ("NVFP4, 16 along tokens + RHT (wgrad)", _tokens("nvfp4", True)),
    ("MXFP4, 32 along tokens (wgrad)", _tokens("mxfp4", False)),
    ("MXFP4, 32 along tokens + RHT (wgrad)", _tokens("mxfp4", True)),
)

#: (label, fn(w) -> (reference, quantized)) for weights (out x in)
WEIGHT_FORMATS = (
    ("paper: E2M1 per output channel", lambda w: (w, fake_quantize(w, "per_channel", "float"))),
    ("NVFP4, 16 along K", lambda w: (w, _fq(w, "nvfp4"))),
    ("NVFP4, 16 x 16 tiles", lambda w: (w, _fq(w, "nvfp4", block_2d=True))),
    ("MXFP4, 32 along K", lambda w: (w, _fq(w, "mxfp4"))),
)


@torch.no_grad()
def block_fidelity_report(tensors: dict[str, torch.Tensor], formats=ACT_FORMATS) -> list[dict]:
    """Pooled SQNR (dB) of each format over ``tensors`` (name -> 2-D fp32)."""
    if not tensors:
        raise ValueError("block_fidelity_report: no tensors to score")
    rows = []
    for label, fn in formats:
        sig = err = 0.0
        for x in tensors.values():
            ref, q = fn(x.float())
            ref, q = ref.double(), q.double()
            sig += float(ref.pow(2).sum())
            err += float((q - ref).pow(2).sum())
        rows.append({"format": label, "sqnr_db": 10 * torch.log10(torch.tensor(sig / max(err, 1e-300))).item()})
    return rows


def format_block_table(act_rows: list[dict], weight_rows: list[dict] | None = None) -> str:
    lines = ["| tensor | format | SQNR (dB) |", "|---|---|---|"]
    lines += [f"| activations | {r['format']} | {r['sqnr_db']:.2f} |" for r in act_rows]
    lines += [f"| weights | {r['format']} | {r['sqnr_db']:.2f} |" for r in (weight_rows or [])]
    return "\n".join(lines)


def checkpoint_report(checkpoint: Path, data_dir: Path, seq_len: int, batches: int = 4,
                      batch_size: int = 8) -> tuple[list[dict], list[dict]]:
    """(activation rows, weight rows) for a trained checkpoint on held-out windows of ``data_dir``."""
    from .fidelity import _quantized_layers, capture_linear_inputs
    from .checkpoint import load_checkpoint
    from .config import FP4Config
    from .data import PreparedData, ValWindowDataset

    model, _, _ = load_checkpoint(checkpoint)
    ds = ValWindowDataset(PreparedData(data_dir).shards("val"), seq_len, batches * batch_size)
    windows = [ds[i][:-1] for i in range(len(ds))]
    acts = capture_linear_inputs(model, [torch.stack(windows[i:i + batch_size])
                                         for i in range(0, len(windows), batch_size)])
    weights = {n: m.weight.detach().float() for n, m in _quantized_layers(model, FP4Config())}
    return block_fidelity_report(acts, ACT_FORMATS), block_fidelity_report(weights, WEIGHT_FORMATS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="SQNR of every FP4 format on a checkpoint's activations and weights")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("data_dir", type=Path)
    p.add_argument("--seq-len", type=int, default=256)
    a = p.parse_args(argv)
    print(format_block_table(*checkpoint_report(a.checkpoint, a.data_dir, a.seq_len)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
