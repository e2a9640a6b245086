"""Random Hadamard transforms (RHT) for the weight-gradient GeMM of the block-FP4 recipes.

A block-scaled quantizer loses accuracy when one outlier inflates its block's scale.
Multiplying both operands of a GeMM by the same orthogonal matrix along the reduction
dimension leaves the product unchanged in exact arithmetic,
``(Q^T G)^T (Q^T A) = G^T Q Q^T A = G^T A``, while spreading each outlier over the block.
NVIDIA's NVFP4 recipe (arXiv 2509.25149) and Tseng et al. 2025 ("Training LLMs with
MXFP4") apply such a transform to the inputs of the wgrad GeMM ``dW = dY^T A``, whose
reduction dimension is the token dimension.

Here ``Q = diag(s) H / sqrt(16)`` with ``H`` the 16 x 16 Sylvester Hadamard matrix and
``s`` random signs drawn from a fixed seed (so the transform is reproducible on resume);
it acts block-diagonally, on consecutive groups of 16 along the chosen dimension. A
dimension that is not a multiple of 16 is zero-padded (zero rows add nothing to the
product); callers slice the padding off if they need the original length.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["RHT_SIZE", "hadamard_matrix", "rht_matrix", "apply_rht"]

RHT_SIZE = 16  # the transform size used by the NVFP4 recipe (16 x 16)


@functools.lru_cache(maxsize=8)
def _sylvester(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int = RHT_SIZE) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +/-1, ``H H^T = n I``), float64."""
    return _sylvester(n).clone()


@functools.lru_cache(maxsize=64)
def _rht_cpu(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).double().mul_(2).sub_(1)
    return signs[:, None] * _sylvester(n) / n ** 0.5  # diag(s) H / sqrt(n), orthogonal


def rht_matrix(seed: int, n: int = RHT_SIZE, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthogonal ``Q = diag(s) H / sqrt(n)`` with random signs ``s`` drawn from ``seed``."""
    return _rht_cpu(int(seed), n).to(device=device, dtype=dtype)


def apply_rht(x: torch.Tensor, q: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``Q^T`` applied to every consecutive group of ``n`` entries along ``dim`` of 2-D ``x``.

    Returns fp32, with ``dim`` zero-padded to a multiple of ``n``. Applying it to both
    operands of ``G^T A`` along their shared dimension leaves the product unchanged.
    """
    if x.dim() != 2:
        raise ValueError(f"apply_rht: expected a 2-D tensor, got shape {tuple(x.shape)}")
    n = q.shape[0]
    xf = x.float()
    if dim == 1:
        return apply_rht(xf.t(), q, 0).t()
    r = (-xf.shape[0]) % n
    if r:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, r))
    m, c = xf.shape
    blocks = xf.reshape(m // n, n, c)  # (M/n, n, C)
    out = torch.matmul(q.t().to(torch.float32), blocks)  # Q^T per block
    return out.reshape(m, c)
