"""Swap ``nn.Linear`` layers for ``FP4Linear`` in place (after torchao's
``convert_to_float8_training``).

Conversion is in place because Lightning's ``Precision.convert_module`` return value
is ignored by its strategies. Parameters are shared, not copied, so optimizer
references, parameter names and state-dict keys are unchanged. Layers left in high
precision on purpose (the output head, ``FP4Config.skip_modules``, a ``module_filter_fn``,
``keep_first_n`` / ``keep_last_n``) are reported as one INFO log line each (logger
``fp4lightning.convert``); layers that *cannot* be converted (unsupported shape, a
Linear-like type) get a warning naming their fully qualified name and the reason.

The output head stays in high precision (arXiv 2501.17116, section 4), whatever its name:
without a ``module_filter_fn``, a Linear is the head when its name matches
``FP4Config.skip_modules`` *or* when it is structurally the head: its weight is tied to an
``nn.Embedding``, or its ``out_features`` equals the vocabulary (``num_embeddings``) of an
embedding in the model (a BERT-style ``decoder``, a ``classifier``, ...). Linear-like layers
that are not converted (subclasses of ``nn.Linear`` such as ``nn.MultiheadAttention``'s
``out_proj``, whose parent calls the weight directly, and ``MultiheadAttention``'s packed
input projection) are reported too, once each, with the reason (docs/lightning.md).
"""
from __future__ import annotations

import fnmatch
import logging
import warnings
from typing import Callable

import torch
from torch import nn

from .config import FP4Config
from .cpu_bf16 import is_plain_linear
from .linear import FP4Linear, check_fp4_shape

__all__ = ["convert_to_fp4", "fp4_modules", "matches_skip"]

log = logging.getLogger(__name__)


def matches_skip(fqn: str, config: FP4Config) -> bool:
    """True when the fully qualified module name ``fqn`` matches one of ``config.skip_modules``
    (fnmatch patterns): the one predicate for "left in high precision by the config"."""
    return any(fnmatch.fnmatchcase(fqn, pat) for pat in config.skip_modules)


def _head_reason(embeddings: list[nn.Embedding], linear: nn.Linear) -> str | None:
    """Why ``linear`` is structurally the output head of the model holding ``embeddings`` (None if not)."""
    if any(e.weight is linear.weight for e in embeddings):
        return "output head: weight tied to an nn.Embedding"
    vocab = {e.num_embeddings for e in embeddings}
    if linear.out_features in vocab and linear.in_features != linear.out_features:
        return f"output head: out_features={linear.out_features} is the vocabulary size of an nn.Embedding"
    return None


def _linear_like_reason(child: nn.Module, parent: nn.Module) -> str | None:
    """Why a Linear-like layer that is not exactly ``nn.Linear`` is left alone (None: not Linear-like)."""
    if isinstance(child, nn.MultiheadAttention):
        if child.in_proj_weight is not None or getattr(child, "q_proj_weight", None) is not None:
            return ("nn.MultiheadAttention: its input projections are parameters that its fused forward "
                    "(F.multi_head_attention_forward) uses directly, so they run in high precision")
        return None
    if isinstance(child, nn.Linear):
        why = f"{type(child).__module__}.{type(child).__qualname__} is a subclass of nn.Linear"
        if isinstance(parent, nn.MultiheadAttention):
            return why + "; nn.MultiheadAttention reads its weight directly in its fused forward, so it stays high precision"
        return why + "; only exact nn.Linear is converted (a subclass may override forward); wrap it yourself with FP4Linear.from_linear"
    return None


def _report_rank() -> bool:
    """Warn on rank 0 only: every rank converts the same model."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_rank() != 0)


def convert_to_fp4(
    module: nn.Module,
    config: FP4Config | str | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` inside ``module`` by an ``FP4Linear``, in place.

    Args:
        module: the model; modified in place and also returned for convenience.
        config: an ``FP4Config`` or a preset name (default: ``"paper"``).
        module_filter_fn: ``fn(module, fqn) -> bool``; False keeps that Linear in high
            precision. When given it replaces the ``config.skip_modules`` patterns.
    """
    if isinstance(config, str):
        config = FP4Config.from_preset(config)
    config = config or FP4Config()
    if isinstance(module, nn.Linear) and type(module) is not FP4Linear:
        raise TypeError("convert_to_fp4 converts the Linear layers *inside* a module, in place; "
                        "wrap a bare nn.Linear with FP4Linear.from_linear(layer) instead")
    skipped: list[str] = []  # cannot be converted: warned
    kept: list[str] = []  # kept in high precision on purpose: logged at INFO
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    from .block_linear import positional_keep  # keep_first_n / keep_last_n transformer blocks
    by_position = positional_keep(module, config.keep_first_n, config.keep_last_n)
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            # exact type: subclasses (and FP4Linear) are left alone, except fp4lightning's own
            # EmulatedBF16Linear, which is nn.Linear with its bf16 GeMMs computed in fp32
            if not is_plain_linear(child):
                why = None if isinstance(child, FP4Linear) else _linear_like_reason(child, parent)
                if why:
                    skipped.append(f"{fqn} ({why})")
                continue
            if module_filter_fn is not None:
                keep = module_filter_fn(child, fqn)
            else:
                keep = not matches_skip(fqn, config)
                if keep:
                    head = _head_reason(embeddings, child)
                    if head:
                        kept.append(f"{fqn} ({head})")
                        continue
            if not keep:
                kept.append(f"{fqn} (excluded by the module filter)")
                continue
            if any(fqn.startswith(p) for p in by_position):
                kept.append(f"{fqn} (keep_first_n/keep_last_n)")
                continue
            why = check_fp4_shape(child.in_features, child.out_features)
            if why:
                skipped.append(f"{fqn} ({why})")
                continue
            setattr(parent, child_name, FP4Linear.from_linear(child, config))
    if _report_rank():
        for item in dict.fromkeys(kept):  # once each
            log.info("convert_to_fp4: keeping %s in high precision", item)
        for item in dict.fromkeys(skipped):
            warnings.warn(f"convert_to_fp4: keeping {item} in high precision", stacklevel=2)
    return module


def fp4_modules(module: nn.Module) -> list[str]:
    """Fully qualified names of the FP4Linear layers in ``module``."""
    return [name for name, m in module.named_modules() if isinstance(m, FP4Linear)]
