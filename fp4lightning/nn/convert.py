"""Swap ``nn.Linear`` layers for ``FP4Linear`` in place (after torchao's
``convert_to_float8_training``).

Conversion is in place because Lightning's ``Precision.convert_module`` return value
is ignored by its strategies. Parameters are shared, not copied, so optimizer
references, parameter names and state-dict keys are unchanged. Layers left in high
precision on purpose (the output head, ``FP4Config.skip_modules``, a ``module_filter_fn``,
``keep_first_n`` / ``keep_last_n``) are reported as one INFO log line each (logger
``fp4lightning.nn.convert``); layers that *cannot* be converted (unsupported shape, a
Linear-like type) get a warning naming their fully qualified name and the reason.

The output head stays in high precision (arXiv 2501.17116, section 4), whatever its name:
without a ``module_filter_fn``, a Linear is the head when its name matches
``FP4Config.skip_modules`` *or* when it is structurally the head: its weight is tied to an
``nn.Embedding``, or its ``out_features`` equals the vocabulary (``num_embeddings``) of an
embedding in the model (a BERT-style ``decoder``, a ``classifier``, ...). Linear-like layers
that are not converted (subclasses of ``nn.Linear`` such as ``nn.MultiheadAttention``'s
``out_proj``, whose parent calls the weight directly, and ``MultiheadAttention``'s packed
input projection) are reported too, once each, with the reason (docs/lightning.md).

A task head that is none of these (a ``classifier`` onto a few labels) trains in FP4 unless it
is listed in ``skip_modules``: :func:`describe_conversion` names every layer on each side, which
the precision plugins print once per run, with the way to keep one in high precision.
"""
from __future__ import annotations

import fnmatch
import logging
import warnings
from typing import Callable

import torch
from torch import nn

from fp4lightning.config import DEFAULT_SKIP_MODULES, FP4Config
from fp4lightning.numerics.cpu_bf16 import is_plain_linear
from fp4lightning.nn.linear import FP4Linear, check_fp4_shape

__all__ = ["convert_to_fp4", "describe_conversion", "fp4_modules", "matches_skip", "positional_keep"]

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


def positional_keep(module: nn.Module, keep_first_n: int, keep_last_n: int) -> list[str]:
    """Name prefixes (``"layers.0."``) of the first/last transformer blocks to keep in high precision
    (``FP4Config.keep_first_n`` / ``keep_last_n``).

    The blocks are the children of the longest ``nn.ModuleList`` that holds Linear layers
    (``layers`` in ``fp4lightning.models.llama``, ``model.layers`` in Hugging Face LLaMA). A model
    without one (an MLP, an ``nn.Sequential``) has its Linear layers for blocks, in model order:
    ``keep_last_n=1`` keeps its last Linear layer.
    """
    if keep_first_n <= 0 and keep_last_n <= 0:
        return []
    best, best_name = None, ""
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and any(isinstance(c, nn.Linear) for c in m.modules()):
            if best is None or len(m) > len(best):
                best, best_name = m, name
    if best is None:
        blocks = [f"{name}." for name, m in module.named_modules() if isinstance(m, nn.Linear) and name]
    else:
        prefix = f"{best_name}." if best_name else ""
        blocks = [f"{prefix}{i}." for i in range(len(best))]
    n = len(blocks)
    idx = sorted(set(range(min(keep_first_n, n))) | set(range(max(0, n - keep_last_n), n)))
    return [blocks[i] for i in idx]


def _children(module: nn.Module):
    """``(fqn, parent, name, child)`` of every submodule of ``module`` (listed first: the caller may
    replace children as it goes)."""
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            yield (f"{parent_name}.{child_name}" if parent_name else child_name), parent, child_name, child


def _why_high_precision(fqn: str, linear: nn.Linear, config: FP4Config, module_filter_fn,
                        embeddings: list[nn.Embedding], by_position: list[str]) -> tuple[bool, str] | None:
    """Why the plain ``nn.Linear`` ``fqn`` stays in high precision, ``(on_purpose, reason)``: on purpose
    (the module filter, or else ``skip_modules`` or being the output head; then keep_first_n /
    keep_last_n), or because its shape cannot be FP4. None: it is converted."""
    if module_filter_fn is not None:
        if not module_filter_fn(linear, fqn):
            return True, "excluded by the module filter"
    elif matches_skip(fqn, config):
        return True, "FP4Config.skip_modules"
    else:
        head = _head_reason(embeddings, linear)
        if head:
            return True, head
    if any(f"{fqn}.".startswith(p) for p in by_position):
        return True, "keep_first_n/keep_last_n"
    why = check_fp4_shape(linear.in_features, linear.out_features)
    return None if why is None else (False, why)


def _plan(module: nn.Module, config: FP4Config, module_filter_fn: Callable[[nn.Module, str], bool] | None):
    """``(fqn, parent, name, child, why)`` for every Linear-like layer of ``module``: ``why`` is None
    when it runs in FP4 (an ``FP4Linear``, or an ``nn.Linear`` to convert), else ``(on_purpose, reason)``
    for one that stays in high precision (on purpose: the head, the config, the filter; or because it
    cannot be converted)."""
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    by_position = positional_keep(module, config.keep_first_n, config.keep_last_n)
    for fqn, parent, name, child in _children(module):
        if isinstance(child, FP4Linear):
            yield fqn, parent, name, child, None
        elif not is_plain_linear(child):
            # exact type: subclasses are left alone, except fp4lightning's own EmulatedBF16Linear,
            # which is nn.Linear with its bf16 GeMMs computed in fp32
            why = _linear_like_reason(child, parent)
            if why:
                yield fqn, parent, name, child, (False, why)
        else:
            yield fqn, parent, name, child, _why_high_precision(fqn, child, config, module_filter_fn, embeddings,
                                                                by_position)


def _as_config(config: FP4Config | str | None) -> FP4Config:
    if isinstance(config, str):
        return FP4Config.from_preset(config)
    return config or FP4Config()


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
    config = _as_config(config)
    if isinstance(module, nn.Linear) and type(module) is not FP4Linear:
        raise TypeError("convert_to_fp4 converts the Linear layers *inside* a module, in place; "
                        "wrap a bare nn.Linear with FP4Linear.from_linear(layer) instead")
    skipped: list[str] = []  # cannot be converted: warned
    kept: list[str] = []  # kept in high precision on purpose: logged at INFO
    for fqn, parent, name, child, why in _plan(module, config, module_filter_fn):
        if why is None:
            if not isinstance(child, FP4Linear):
                setattr(parent, name, FP4Linear.from_linear(child, config))
        else:
            (kept if why[0] else skipped).append(f"{fqn} ({why[1]})")
    if _report_rank():
        for item in dict.fromkeys(kept):  # once each
            log.info("convert_to_fp4: keeping %s in high precision", item)
        for item in dict.fromkeys(skipped):
            warnings.warn(f"convert_to_fp4: keeping {item} in high precision", stacklevel=2)
    return module


def _span(values: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0..3"``; ``[0, 3]`` -> ``"{0,3}"``; ``[5]`` -> ``"5"``."""
    values = sorted(set(values))
    if len(values) == 1:
        return str(values[0])
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return "{" + ",".join(map(str, values)) + "}"


def _grouped_names(names: list[str]) -> list[str]:
    """Layer names with repeated blocks collapsed, in the order given: ``layers.0.attn.wq`` ...
    ``layers.3.attn.wk`` -> ``layers.0..3.attn.{wq,wk} (8)``."""
    by_pattern: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    for name in names:
        parts = name.split(".")
        by_pattern.setdefault(tuple("#" if p.isdigit() else p for p in parts), []).append(
            tuple(int(p) for p in parts if p.isdigit()))
    # the same blocks, differing in the last (non-numeric) name only: one entry, the last names in braces
    by_parent: dict[tuple, list[str]] = {}
    for pattern, indices in by_pattern.items():
        merge = len(pattern) > 1 and pattern[-1] != "#"
        key = (pattern[:-1], tuple(indices)) if merge else (pattern, tuple(indices))
        by_parent.setdefault(key, []).extend([pattern[-1]] if merge else [])
    out = []
    for (pattern, indices), leaves in by_parent.items():
        spans = iter(_span(list(col)) for col in zip(*indices))
        parts = [next(spans) if p == "#" else p for p in pattern]
        if leaves:
            parts.append(leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}")
        count = len(indices) * max(1, len(leaves))
        out.append(".".join(parts) + (f" ({count})" if count > 1 else ""))
    return out


def describe_conversion(module: nn.Module, config: FP4Config | str | None = None,
                        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                        who: str = "convert_to_fp4") -> str:
    """Which Linear layers of ``module`` run in FP4 and which stay in high precision (and why), by
    name with repeated blocks collapsed, and how to keep a layer in high precision: what the
    precision plugins print once per run. Describes what :func:`convert_to_fp4` with the same
    arguments does, or did (converted layers count as FP4)."""
    config = _as_config(config)
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    plan = sorted(_plan(module, config, module_filter_fn), key=lambda item: order[item[0]])
    fp4 = [fqn for fqn, *_, why in plan if why is None]
    high: dict[str, list[str]] = {}
    for fqn, *_, why in plan:
        if why is not None:
            high.setdefault(why[1], []).append(fqn)
    kept = "; ".join(f"{', '.join(_grouped_names(names))} ({reason})" for reason, names in high.items())
    lines = [f"{who}: Linear layers in FP4 ({len(fp4)}): {', '.join(_grouped_names(fp4)) or 'none'}",
             f"{who}: Linear layers in high precision ({len(plan) - len(fp4)}): {kept or 'none'}"]
    if fp4:
        if module_filter_fn is not None:
            how = "return False for it from module_filter_fn"
        else:
            now = ("DEFAULT_SKIP_MODULES" if config.skip_modules == DEFAULT_SKIP_MODULES
                   else repr(config.skip_modules))
            how = (f"add its name to FP4Config.skip_modules (fnmatch patterns; recipe key "
                   f"fp4.overrides.skip_modules), e.g. skip_modules={now} + ({fp4[-1]!r},); "
                   "keep_first_n / keep_last_n keep whole transformer blocks")
        lines.append(f"{who}: to keep a layer in high precision, {how}")
    return "\n".join(lines)


def fp4_modules(module: nn.Module) -> list[str]:
    """Fully qualified names of the FP4Linear layers in ``module``."""
    return [name for name, m in module.named_modules() if isinstance(m, FP4Linear)]
