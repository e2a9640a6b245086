"""Every knob of the FP4 recipe in one frozen dataclass, with named presets.

Presets (``FP4Config.from_preset(name)``):

* ``paper``       - the method as published (arXiv 2501.17116): per-channel weights and
                    per-token activations with float absmax scales, DGE (k=5, clamp 3) on
                    weights, OCC (alpha=0.99, compensated) on activations, dY in FP8 E5M2.
* ``w4a4-direct`` - plain FP4 casts of both operands, straight-through gradients, no OCC
                    (the paper's "direct cast" baseline).
* ``fp4-no-dge``  - ``paper`` with STE instead of DGE.
* ``fp4-no-occ``  - ``paper`` without outlier clamping.

Block-scaled recipes (beyond the paper; docs/lightning.md, "Block-scaled recipes"):

* ``nvfp4``        - NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149): 16-element
                     blocks with E4M3 scales and a per-tensor fp32 scale, 16x16 weight
                     tiles, a 16-point random Hadamard transform on the wgrad operands,
                     stochastic rounding of the gradient in both backward GeMMs, first
                     and last transformer blocks in high precision (the paper keeps about
                     16% of a 12B model's blocks; here one at each end, raise
                     ``keep_first_n`` / ``keep_last_n`` for deep models). No DGE / OCC.
* ``mxfp4``        - plain OCP MXFP4 (OCP Microscaling Formats spec v1.0): 32-element
                     blocks with E8M0 power-of-two scales, round-to-nearest everywhere.
* ``mxfp4-rht-sr`` - MXFP4 with the random Hadamard transform on the wgrad operands and
                     stochastic rounding of every backward-GeMM operand (Tseng et al. 2025,
                     "Training LLMs with MXFP4"; Quartet, Castro et al. 2025, uses the same
                     unbiased backward).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fp4lightning.numerics.constants import DY_FORMATS

__all__ = ["FP4Config", "PRESETS", "DEFAULT_SKIP_MODULES"]

#: Fully qualified module-name patterns (fnmatch) left in high precision by default:
#: the output head, as in the paper and in NVIDIA's and torchtitan's FP4/FP8 recipes.
DEFAULT_SKIP_MODULES = ("lm_head", "*.lm_head", "output", "*.output", "head", "*.head")

_CHOICES = {
    "weight_granularity": ("per_channel", "per_tensor"),
    "act_granularity": ("per_token", "per_tensor"),
    "scale_mode": ("float", "pow2"),
    "occ_quantile": ("sample", "exact"),
    "grad_format": DY_FORMATS,
    "block_format": ("none", "block16_e4m3", "block32_e8m0"),
}
#: GeMM operands that ``stochastic_rounding`` may name (block formats only)
SR_OPERANDS = ("fprop.a", "fprop.w", "dgrad.g", "dgrad.w", "wgrad.g", "wgrad.a")


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
    # --- block-scaled recipes (fp4lightning.nn.block_linear); "none" = the paper's per-row scales
    #: "block16_e4m3" (NVFP4: 16-element blocks, E4M3 scales, per-tensor fp32 scale) or
    #: "block32_e8m0" (MXFP4: 32-element blocks, power-of-two scales); the block size follows
    block_format: str = "none"
    #: 16x16 weight tiles (NVFP4 only): one quantized weight serves fprop and dgrad
    weight_block_2d: bool = False
    #: GeMM operands rounded stochastically: any of SR_OPERANDS ("wgrad.g", ...)
    stochastic_rounding: tuple[str, ...] = ()
    #: seed of the stochastic rounding draws (mixed with each operand's bits: resumable)
    sr_seed: int = 0
    #: 16-point random Hadamard transform of both wgrad operands along the token dim
    rht_wgrad: bool = False
    #: seed of the Hadamard transform's random signs
    rht_seed: int = 0
    #: keep the first / last N transformer blocks in high precision (convert_to_fp4)
    keep_first_n: int = 0
    keep_last_n: int = 0
    #: experiment (docs/results.md): STE times DGE's factor frozen at init; needs dge=False
    dge_frozen_factor: bool = False
    #: opt-in (docs/perf.md, "OCC on the GPU"): fold OCC's residual into the activation operand
    #: and round it to E4M3 (fp4lightning.numerics.occ.fold_e4m3) instead of computing the compensation in
    #: bf16; the forward and weight-gradient GeMMs then need no compensation products. Needs OCC
    #: with compensation; on the Triton backend it needs FP8 tensor cores (sm_90) and an FP8 dY
    occ_fold_e4m3: bool = False

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
        _check_block_knobs(self)
        if self.occ_fold_e4m3 and not (self.occ and self.occ_compensation and self.block_format == "none"):
            raise ValueError("FP4Config.occ_fold_e4m3 folds OCC's compensation into the activation operand: it "
                             "needs occ=True and occ_compensation=True with block_format='none' (e.g. the paper "
                             "preset)")

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


def _check_block_knobs(cfg: FP4Config) -> None:
    sr = cfg.stochastic_rounding
    if isinstance(sr, str) or not all(isinstance(o, str) for o in sr):
        raise TypeError("FP4Config.stochastic_rounding must be a tuple of operand names, e.g. ('wgrad.g',)")
    object.__setattr__(cfg, "stochastic_rounding", tuple(sr))
    bad = [o for o in sr if o not in SR_OPERANDS]
    if bad:
        raise ValueError(f"FP4Config.stochastic_rounding: unknown operand(s) {bad}; choose from {SR_OPERANDS}")
    for key in ("sr_seed", "rht_seed", "keep_first_n", "keep_last_n"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"FP4Config.{key} must be a non-negative integer, got {v!r}")
    if cfg.block_format == "none":
        for key, off in (("weight_block_2d", False), ("stochastic_rounding", ()), ("rht_wgrad", False)):
            if getattr(cfg, key) != off:
                raise ValueError(f"FP4Config.{key} needs a block format; set block_format to 'block16_e4m3' "
                                 "or 'block32_e8m0' (or use the nvfp4 / mxfp4 presets)")
    if cfg.weight_block_2d and cfg.block_format != "block16_e4m3":
        raise ValueError("FP4Config.weight_block_2d: 16x16 weight tiles are defined for block_format="
                         "'block16_e4m3' (NVFP4) only")


PRESETS: dict[str, FP4Config] = {
    "paper": FP4Config(),
    "w4a4-direct": FP4Config(dge=False, occ=False),
    "fp4-no-dge": FP4Config(dge=False),
    "fp4-no-occ": FP4Config(occ=False),
    "nvfp4": FP4Config(block_format="block16_e4m3", weight_block_2d=True, stochastic_rounding=("dgrad.g", "wgrad.g"),
                       rht_wgrad=True, dge=False, occ=False, keep_first_n=1, keep_last_n=1),
    "mxfp4": FP4Config(block_format="block32_e8m0", dge=False, occ=False),
    "mxfp4-rht-sr": FP4Config(block_format="block32_e8m0", rht_wgrad=True, dge=False, occ=False,
                              stochastic_rounding=("dgrad.g", "dgrad.w", "wgrad.g", "wgrad.a")),
}
