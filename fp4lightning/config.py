"""Every knob of the FP4 recipe in one frozen dataclass, with named presets.

Presets (``FP4Config.from_preset(name)``):

* ``paper``       - the method as published (arXiv 2501.17116): per-channel weights and
                    per-token activations with float absmax scales, DGE (k=5, clamp 3) on
                    weights, OCC (alpha=0.99, compensated) on activations, dY in FP8 E5M2.
* ``w4a4-direct`` - plain FP4 casts of both operands, straight-through gradients, no OCC
                    (the paper's "direct cast" baseline).
* ``fp4-no-dge``  - ``paper`` with STE instead of DGE.
* ``fp4-no-occ``  - ``paper`` without outlier clamping.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["FP4Config", "PRESETS", "DEFAULT_SKIP_MODULES"]

#: Fully qualified module-name patterns (fnmatch) left in high precision by default:
#: the output head, as in the paper and in NVIDIA's and torchtitan's FP4/FP8 recipes.
DEFAULT_SKIP_MODULES = ("lm_head", "*.lm_head", "output", "*.output", "head", "*.head")

_CHOICES = {
    "weight_granularity": ("per_channel", "per_tensor"),
    "act_granularity": ("per_token", "per_tensor"),
    "scale_mode": ("float", "pow2"),
    "occ_quantile": ("sample", "exact"),
    "grad_format": ("e5m2", "e4m3", "bf16"),
}


@dataclass(frozen=True)
class FP4Config:
    """Configuration of FP4 linear layers (see module docstring for the presets)."""

    #: one scale per output channel (row of W), or one for the whole weight (ablation)
    weight_granularity: str = "per_channel"
    #: one scale per token (row of A), or one for the whole activation (ablation)
    act_granularity: str = "per_token"
    #: "float": scale = 6/amax exactly; "pow2": rounded down to a power of two
    scale_mode: str = "float"
    #: Differentiable Gradient Estimator on the weight quantizer (else straight-through)
    dge: bool = True
    dge_k: float = 5.0
    dge_clamp: float = 3.0
    #: Outlier Clamping (and Compensation) on the input activations
    occ: bool = True
    occ_alpha: float = 0.99
    occ_compensation: bool = True
    #: how the clamp quantiles are found: "sample" (fast estimate) or "exact" (selection)
    occ_quantile: str = "sample"
    occ_sample_size: int = 65536
    #: format of dY in the two backward GeMMs
    grad_format: str = "e5m2"
    #: fnmatch patterns of fully qualified module names to leave in high precision
    skip_modules: tuple[str, ...] = field(default=DEFAULT_SKIP_MODULES)
    #: experiment (docs/results.md): STE times DGE's factor frozen at init; needs dge=False
    dge_frozen_factor: bool = False

    def __post_init__(self):
        for key, choices in _CHOICES.items():
            value = getattr(self, key)
            if value not in choices:
                raise ValueError(f"FP4Config.{key}={value!r} is not one of {choices}")
        if not self.dge_k > 1.0:
            raise ValueError(f"FP4Config.dge_k must be > 1 (the paper uses 5), got {self.dge_k}")
        if not self.dge_clamp > 0:
            raise ValueError(f"FP4Config.dge_clamp must be positive (the paper uses 3), got {self.dge_clamp}")
        if not 0.5 < self.occ_alpha < 1.0:
            raise ValueError(f"FP4Config.occ_alpha must be in (0.5, 1) (the paper uses 0.99), got {self.occ_alpha}")
        if self.occ_sample_size < 1024:
            raise ValueError(f"FP4Config.occ_sample_size must be at least 1024, got {self.occ_sample_size}")
        if isinstance(self.skip_modules, str) or not all(isinstance(p, str) for p in self.skip_modules):
            raise TypeError("FP4Config.skip_modules must be a tuple of strings (fnmatch patterns)")
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "FP4Config":
        """A named preset (``paper``, ``w4a4-direct``, ``fp4-no-dge``, ``fp4-no-occ``) plus overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown FP4 preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def replace(self, **changes) -> "FP4Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["skip_modules"] = list(self.skip_modules)
        return d


PRESETS: dict[str, FP4Config] = {
    "paper": FP4Config(),
    "w4a4-direct": FP4Config(dge=False, occ=False),
    "fp4-no-dge": FP4Config(dge=False),
    "fp4-no-occ": FP4Config(occ=False),
}
