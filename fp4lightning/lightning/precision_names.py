"""The ``precision=`` strings fp4lightning understands, in one place (imports nothing).

``fp4lightning.Trainer`` turns the FP4 strings into :class:`~fp4lightning.lightning.precision.FP4Precision`
(docs/lightning.md); recipes (``trainer.precision``) accept the FP4 strings and the Lightning
precisions listed here (not 16-true: :data:`REFUSED_PRECISIONS`); ``fp4lightning compare`` names its
high-precision baselines with :data:`HIGH_PRECISION_VARIANTS`.
"""

from __future__ import annotations

__all__ = ["FP4_PRECISIONS", "LIGHTNING_PRECISIONS", "REFUSED_PRECISIONS", "RECIPE_PRECISIONS", "FSDP_PRECISIONS",
           "MIXED_PRECISION", "HIGH_PRECISION_VARIANTS"]

#: ``precision=`` strings added by fp4lightning -> the autocast dtype around the FP4 GeMMs
FP4_PRECISIONS: dict[str, str] = {"fp4": "bf16", "fp4-bf16": "bf16", "fp4-fp16": "fp16"}
#: Lightning's own precision strings a recipe may name
LIGHTNING_PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "32-true", "64-true")
#: Lightning precisions a recipe refuses -> why (the recipe error says it, with the working choices)
REFUSED_PRECISIONS: dict[str, str] = {
    "16-true": "it keeps the weights and AdamW's state in fp16, where optimizer.eps (1e-8) underflows to 0, so "
               "the first optimizer step writes inf/NaN weights; for fp16 use 16-mixed (fp16 autocast, fp32 "
               "weights) or fp4-fp16 (FP4 GeMMs, fp16 elsewhere, loss scaling)",
}
#: what a recipe's ``trainer.precision`` accepts
RECIPE_PRECISIONS = (*FP4_PRECISIONS, *LIGHTNING_PRECISIONS)
#: what a recipe's ``trainer.precision`` accepts with ``trainer.strategy: fsdp``: Lightning's ModelParallelStrategy
#: (FSDP2) takes 32-true, bf16-mixed and bf16-true (and 16-true), and FP4 runs there as bf16-mixed + FP4 layers
FSDP_PRECISIONS = ("fp4", "fp4-bf16", "bf16-mixed", "bf16-true", "32-true")
#: FP4 compute dtype -> Lightning's autocast precision, for strategies whose own precision plugin
#: must stay (FSDP: the LightningModule converts the layers instead, docs/distributed.md)
MIXED_PRECISION: dict[str, str] = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
#: ``fp4lightning compare`` baselines -> their Lightning precision
HIGH_PRECISION_VARIANTS: dict[str, str] = {"bf16": "bf16-mixed", "fp32": "32-true"}
