"""OCC fidelity on a model's real activations: the analogue of the paper's Table 1.

arXiv 2501.17116, section 3.3 / Table 1 measures how well the quantized activations of a
trained 1.3B model match the originals with no clamping, clamping only, and clamping with
compensation at alpha = 0.999 / 0.99 / 0.97. ``occ_fidelity_report`` captures the input of
every linear layer that FP4 would quantize (``FP4Linear`` layers, or every ``nn.Linear``
outside ``FP4Config.skip_modules`` in a high-precision model) during a no-grad forward pass,
then scores each variant with cosine similarity, MSE and SNR, pooled over all activations.
``checkpoint_occ_report`` does it for a trained checkpoint on held-out windows
(``fp4lightning occ-fidelity CKPT --data DIR``; ``fp4lightning compare`` adds it to its report).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from fp4lightning.config import FP4Config
from fp4lightning.data import PreparedData, ValWindowDataset
from fp4lightning.nn.convert import matches_skip
from fp4lightning.numerics.cpu_bf16 import is_plain_linear
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.ops.gemm import quantize_fp4_folded
from fp4lightning.numerics.occ import occ_bounds, occ_clamp
from fp4lightning.numerics.absmax import fake_quantize
from fp4lightning.train.checkpoint import load_checkpoint

__all__ = ["VARIANTS", "E4M3_FOLD_VARIANTS", "quantized_layers", "capture_linear_inputs", "LayerRows",
           "heldout_batches", "occ_fidelity", "occ_fidelity_report", "checkpoint_occ_report", "format_occ_table",
           "saved_tensor_bytes"]

#: (label, alpha or None, compensate) rows of the report, in the paper's order
VARIANTS = (
    ("no clamp", None, False),
    ("clamp only, alpha=0.999", 0.999, False),
    ("clamp + comp, alpha=0.999", 0.999, True),
    ("clamp + comp, alpha=0.99", 0.99, True),
    ("clamp + comp, alpha=0.97", 0.97, True),
)
#: Compensation folded into one E4M3 operand (``occ.fold_e4m3``) instead of kept exact: what a
#: GPU forward could run without a second GeMM (docs/perf.md, "OCC on the GPU")
E4M3_FOLD_VARIANTS = (
    ("clamp + comp folded in E4M3, alpha=0.99", 0.99, "e4m3"),
    ("clamp + comp folded in E4M3, alpha=0.97", 0.97, "e4m3"),
)


def quantized_layers(model: nn.Module, config: FP4Config) -> list[tuple[str, nn.Linear]]:
    """``(name, layer)`` of every linear layer FP4 quantizes in ``model``: its ``FP4Linear`` layers, and
    the plain ``nn.Linear`` layers that ``config.skip_modules`` does not keep in high precision (in a
    high-precision model: the layers a conversion with ``config`` would make FP4)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FP4Linear):
            out.append((name, m))
        elif is_plain_linear(m) and not matches_skip(name, config):
            out.append((name, m))
    return out


@torch.no_grad()
def capture_linear_inputs(model: nn.Module, batches: Iterable, config: FP4Config | None = None,
                          max_rows: int = 4096) -> dict[str, torch.Tensor]:
    """Run ``model(batch)`` for each batch; return each quantized layer's input, (rows, K) fp32.

    At most ``max_rows`` rows are kept per layer (the first ones), to bound memory.
    """
    config = config or FP4Config()
    layers = quantized_layers(model, config)
    if not layers:
        raise ValueError("capture_linear_inputs: the model has no linear layers that FP4 would quantize")
    rows = LayerRows([n for n, _ in layers], max_rows)
    handles = [layer.register_forward_pre_hook(lambda mod, args, name=name: rows.add(name, args[0]))
               for name, layer in layers]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return rows.result()


class LayerRows:
    """The first ``max_rows`` rows (last dim kept) of the tensors seen per layer, fp32 on CPU."""

    def __init__(self, names: list[str], max_rows: int):
        self.store: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.max_rows = max_rows

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().reshape(-1, t.shape[-1]).float()
        have = sum(x.shape[0] for x in self.store[name])
        if have < self.max_rows:
            self.store[name].append(t[: self.max_rows - have].cpu())

    def result(self) -> dict[str, torch.Tensor]:
        return {n: torch.cat(v) for n, v in self.store.items() if v}


def occ_fidelity(x: torch.Tensor, alpha: float | None, compensate: bool | str, scale_mode: str = "float"):
    """(signal energy, error energy, dot(x, q), |q|^2, n) of one activation's quantization.

    ``compensate``: False (clamp only), True (the residual added back exactly) or ``"e4m3"``
    (the residual folded into the quantized operand, rounded to E4M3 by ``occ.fold_e4m3``)."""
    if alpha is None:
        q = fake_quantize(x, "per_token", scale_mode)
    else:
        bounds = occ_bounds(x, alpha, "exact")
        if compensate == "e4m3":  # the layer's own fold (FP4Config.occ_fold_e4m3), on the CPU reference path
            e4, s = quantize_fp4_folded(x.reshape(-1, x.shape[-1]).cpu(), bounds.cpu(), scale_mode)
            q = (e4.float() / s[:, None]).reshape(x.shape).to(x.device)
        else:
            xc, r = occ_clamp(x, bounds)
            q = fake_quantize(xc, "per_token", scale_mode)
            if compensate:
                q = q + r
    xd, qd = x.double(), q.double()
    return xd.pow(2).sum(), (qd - xd).pow(2).sum(), (xd * qd).sum(), qd.pow(2).sum(), x.numel()


def occ_fidelity_report(activations: dict[str, torch.Tensor], variants=VARIANTS) -> list[dict]:
    """Pooled cosine similarity, MSE and SNR (dB) over all captured activations, per variant."""
    rows = []
    for label, alpha, comp in variants:
        sig = err = dot = qq = 0.0
        n = 0
        for x in activations.values():
            s, e, d, q2, k = occ_fidelity(x, alpha, comp)
            sig, err, dot, qq, n = sig + s, err + e, dot + d, qq + q2, n + k
        rows.append({
            "variant": label,
            "cosine": float(dot / (sig.sqrt() * qq.sqrt())),
            "mse": float(err / n),
            "snr_db": float(10 * torch.log10(sig / err)),
        })
    return rows


def heldout_batches(data_dir: Path, seq_len: int, batches: int = 4, batch_size: int = 8) -> list[torch.Tensor]:
    """The first ``batches * batch_size`` validation windows of a prepared corpus, as ``batches`` token
    tensors of shape (batch_size, seq_len + 1): inputs ``[:, :-1]``, next-token targets ``[:, 1:]``."""
    data = PreparedData(data_dir)
    ds = ValWindowDataset(data.shards("val"), seq_len, batches * batch_size, **data.id_check("val"))
    windows = [ds[i] for i in range(len(ds))]
    return [torch.stack(windows[i:i + batch_size]) for i in range(0, len(windows), batch_size)]


def checkpoint_occ_report(checkpoint: Path, data_dir: Path, seq_len: int, batches: int = 4, batch_size: int = 8,
                          variants=VARIANTS) -> list[dict]:
    """:func:`occ_fidelity_report` of a trained checkpoint on held-out windows of ``data_dir``."""
    model, _, _ = load_checkpoint(checkpoint)  # high-precision weights: capture what FP4 would see
    acts = capture_linear_inputs(model, [b[:, :-1] for b in heldout_batches(data_dir, seq_len, batches, batch_size)])
    return occ_fidelity_report(acts, variants)


def format_occ_table(rows: list[dict]) -> str:
    """The Markdown table of :func:`occ_fidelity_report`'s rows (cosine in percent)."""
    lines = ["| activations | cosine sim. | MSE | SNR (dB) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {100 * r['cosine']:.2f}% | {r['mse']:.4g} | {r['snr_db']:.2f} |")
    return "\n".join(lines)


def saved_tensor_bytes(module: nn.Module, run) -> int:
    """Bytes autograd saves for backward while ``run()`` executes, parameters excluded.

    Parameters are referenced, not copied, by autograd, so they are not counted; sparse
    CSR tensors (OCC's residual) count their three buffers.
    """
    params = {p.data_ptr() for p in module.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        parts = (t.crow_indices(), t.col_indices(), t.values()) if t.layout == torch.sparse_csr else (t,)
        for p in parts:
            if p.data_ptr() not in params:
                total += p.numel() * p.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total
