"""Swap ``nn.Linear`` layers for ``FP4Linear`` in place (after torchao's
``convert_to_float8_training``).

Conversion is in place because Lightning's ``Precision.convert_module`` return value
is ignored by its strategies. Parameters are shared, not copied, so optimizer
references, parameter names and state-dict keys are unchanged. Layers are skipped,
each with a warning naming its fully qualified name, when the filter rejects them
(by default the output head, ``FP4Config.skip_modules``) or when their shapes are
not supported.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable

from torch import nn

from .config import FP4Config
from .linear import FP4Linear, check_fp4_shape

__all__ = ["convert_to_fp4", "fp4_modules"]


def _skipped_by_config(fqn: str, config: FP4Config) -> bool:
    return any(fnmatch.fnmatchcase(fqn, pat) for pat in config.skip_modules)


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
    skipped: list[str] = []
    from .block_linear import positional_keep  # keep_first_n / keep_last_n transformer blocks
    by_position = positional_keep(module, config.keep_first_n, config.keep_last_n)
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:  # exact type: subclasses (and FP4Linear) are left alone
                continue
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if module_filter_fn is not None:
                keep = module_filter_fn(child, fqn)
            else:
                keep = not _skipped_by_config(fqn, config)
            if not keep:
                skipped.append(f"{fqn} (excluded by the module filter)")
                continue
            if any(fqn.startswith(p) for p in by_position):
                skipped.append(f"{fqn} (keep_first_n/keep_last_n)")
                continue
            why = check_fp4_shape(child.in_features, child.out_features)
            if why:
                skipped.append(f"{fqn} ({why})")
                continue
            setattr(parent, child_name, FP4Linear.from_linear(child, config))
    for item in skipped:
        warnings.warn(f"convert_to_fp4: keeping {item} in high precision", stacklevel=2)
    return module


def fp4_modules(module: nn.Module) -> list[str]:
    """Fully qualified names of the FP4Linear layers in ``module``."""
    return [name for name, m in module.named_modules() if isinstance(m, FP4Linear)]
