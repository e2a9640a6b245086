"""Quantization fidelity of every FP4 format on a model's real tensors, measured in one run.

For the inputs of every linear layer FP4 would quantize (captured as in
``fp4lightning.experiments.occ_fidelity``) and for the weights of those layers, this scores each format's
quantize-dequantize by its SQNR in dB (signal energy over error energy, pooled over
layers):

* the paper's per-token / per-channel E2M1 (arXiv 2501.17116, section 3.1), with and
  without OCC (alpha 0.99, compensated; section 3.3);
* NVFP4 and MXFP4 with blocks along K, as the forward GeMM quantizes A and W;
* NVFP4 and MXFP4 with blocks along the tokens, as the wgrad GeMM quantizes A, with and
  without the 16-point random Hadamard transform (the transform is orthogonal, so the
  error is measured in the rotated basis without changing its energy);
* NVFP4 with 16 x 16 weight tiles;
* for the output gradients dY of those layers (next-token loss on the same batches): the
  paper's FP8 E5M2 with one scale per token (dgrad operand) or per output channel (wgrad
  operand), and NVFP4 / MXFP4 with blocks along the output channels (dgrad) or the tokens
  (wgrad), with the random Hadamard transform and stochastic rounding of the block recipes.
  Stochastic rounding is unbiased but adds noise, so its SQNR is lower than round-to-nearest.

``fp4lightning format-fidelity CHECKPOINT --data DIR [--seq-len N]`` prints the Markdown table
(:func:`checkpoint_format_report`); ``fp4lightning compare`` appends it to its report.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fp4lightning.config import FP4Config
from fp4lightning.experiments.occ_fidelity import LayerRows, capture_linear_inputs, heldout_batches, quantized_layers
from fp4lightning.numerics.block_formats import fake_quantize_block
from fp4lightning.numerics.hadamard import apply_rht, rht_matrix
from fp4lightning.ops.gemm import quantize_fp8_reference
from fp4lightning.numerics.occ import occ_bounds, occ_clamp
from fp4lightning.numerics.absmax import fake_quantize
from fp4lightning.train.checkpoint import load_checkpoint

__all__ = ["ACT_FORMATS", "WEIGHT_FORMATS", "GRAD_FORMATS", "format_fidelity_report", "format_fidelity_table",
           "capture_output_grads", "checkpoint_format_report"]


def _fq(x: torch.Tensor, fmt: str, block_2d: bool = False) -> torch.Tensor:
    v, factor, _ = fake_quantize_block(x, fmt, block_2d=block_2d)
    return v * factor


def _occ_paper(x: torch.Tensor) -> torch.Tensor:
    xc, r = occ_clamp(x, occ_bounds(x, 0.99, "exact"))
    return fake_quantize(xc, "per_token", "float") + r


def _tokens(fmt: str, rht: bool, rounding: str = "nearest"):
    """Blocks along the tokens (dim 0), as the wgrad GeMM quantizes its operands."""
    def run(x: torch.Tensor):
        ref = apply_rht(x, rht_matrix(0, device=x.device), 0) if rht else x
        return ref, _fq_round(ref.t().contiguous(), fmt, rounding).t()
    return run


def _fq_round(x: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    gen = torch.Generator(device=x.device).manual_seed(0) if rounding == "stochastic" else None
    v, factor, _ = fake_quantize_block(x, fmt, rounding=rounding, generator=gen)
    return v * factor


def _fp8(dim: int):
    """The paper's dY: FP8 E5M2, one absmax scale per row (dim=1) or per column (dim=0)."""
    def run(g: torch.Tensor):
        q, scale = quantize_fp8_reference(g, dim, "e5m2")
        return g, q.float() / (scale[:, None] if dim == 1 else scale[None, :])
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


#: (label, fn(dy) -> (reference, quantized)) for output gradients (tokens x out)
GRAD_FORMATS = (
    ("paper: FP8 E5M2 per token (dgrad)", _fp8(1)),
    ("paper: FP8 E5M2 per output channel (wgrad)", _fp8(0)),
    ("NVFP4, 16 along out (dgrad)", lambda g: (g, _fq(g, "nvfp4"))),
    ("NVFP4, 16 along out + SR (dgrad)", lambda g: (g, _fq_round(g, "nvfp4", "stochastic"))),
    ("NVFP4, 16 along tokens (wgrad)", _tokens("nvfp4", False)),
    ("NVFP4, 16 along tokens + RHT + SR (wgrad)", _tokens("nvfp4", True, "stochastic")),
    ("MXFP4, 32 along out (dgrad)", lambda g: (g, _fq(g, "mxfp4"))),
    ("MXFP4, 32 along out + SR (dgrad)", lambda g: (g, _fq_round(g, "mxfp4", "stochastic"))),
    ("MXFP4, 32 along tokens (wgrad)", _tokens("mxfp4", False)),
    ("MXFP4, 32 along tokens + RHT + SR (wgrad)", _tokens("mxfp4", True, "stochastic")),
)


def capture_output_grads(model: torch.nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                         max_rows: int = 4096) -> dict[str, torch.Tensor]:
    """dY of each layer FP4 would quantize under the next-token loss, (rows, out) fp32.

    ``model(inputs[i])`` gives logits scored against ``targets[i]`` (mean cross-entropy);
    at most ``max_rows`` rows are kept per layer. The model's parameters get gradients.
    """
    layers = quantized_layers(model, FP4Config())
    if not layers:
        raise ValueError("capture_output_grads: the model has no linear layers that FP4 would quantize")
    rows = LayerRows([n for n, _ in layers], max_rows)
    handles = [layer.register_full_backward_hook(lambda mod, gin, gout, name=name: rows.add(name, gout[0]))
               for name, layer in layers]
    was_training = model.training
    model.eval()
    try:
        for x, y in zip(inputs, targets):
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return rows.result()


@torch.no_grad()
def format_fidelity_report(tensors: dict[str, torch.Tensor], formats=ACT_FORMATS) -> list[dict]:
    """Pooled SQNR (dB) of each format over ``tensors`` (name -> 2-D fp32)."""
    if not tensors:
        raise ValueError("format_fidelity_report: no tensors to score")
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


def format_fidelity_table(act_rows: list[dict], weight_rows: list[dict] | None = None,
                          grad_rows: list[dict] | None = None) -> str:
    """The Markdown table of :func:`format_fidelity_report`'s rows for activations, weights and gradients."""
    lines = ["| tensor | format | SQNR (dB) |", "|---|---|---|"]
    lines += [f"| activations | {r['format']} | {r['sqnr_db']:.2f} |" for r in act_rows]
    lines += [f"| weights | {r['format']} | {r['sqnr_db']:.2f} |" for r in (weight_rows or [])]
    lines += [f"| gradients (dY) | {r['format']} | {r['sqnr_db']:.2f} |" for r in (grad_rows or [])]
    return "\n".join(lines)


def checkpoint_format_report(checkpoint: Path, data_dir: Path, seq_len: int, batches: int = 4,
                             batch_size: int = 8, gradients: bool = False) -> tuple[list[dict], ...]:
    """(activation rows, weight rows), plus gradient rows with ``gradients=True``, for a trained
    checkpoint on held-out windows of ``data_dir``."""
    model, _, _ = load_checkpoint(checkpoint)
    tokens = heldout_batches(data_dir, seq_len, batches, batch_size)
    inputs, targets = [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]
    acts = capture_linear_inputs(model, inputs)
    weights = {n: m.weight.detach().float() for n, m in quantized_layers(model, FP4Config())}
    rows = (format_fidelity_report(acts, ACT_FORMATS), format_fidelity_report(weights, WEIGHT_FORMATS))
    if not gradients:
        return rows
    grads = capture_output_grads(model, inputs, targets)
    return (*rows, format_fidelity_report(grads, GRAD_FORMATS))
