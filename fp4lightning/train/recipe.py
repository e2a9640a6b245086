"""Recipe schema: YAML + ``key=value`` overrides -> a frozen :class:`RecipeConfig`.

Config flows one way: ``OmegaConf.merge(structured schema, recipe YAML, command-line
dotlist)`` -> plain frozen dataclasses. This is the only module that imports OmegaConf.
Unknown keys, wrong types and invalid choices fail before anything is built, with a
:class:`RecipeError` naming the dotted key (``model.n_layers``) and the valid choices.

The schema defaults are the ``tiny`` recipe (``recipes/tiny.yaml`` spells them out), so
``fp4lightning train`` without a recipe trains the tiny model. The paper's settings
(arXiv 2501.17116, section 7) live in ``recipes/llama2-{1.3b,7b,13b}.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from fp4lightning.config import PRESETS, FP4Config
from fp4lightning.errors import UsageError
from fp4lightning.models.config import LLAMA_CONFIGS, LlamaConfig
from fp4lightning.lightning.precision_names import FSDP_PRECISIONS, RECIPE_PRECISIONS, REFUSED_PRECISIONS

__all__ = [
    "RecipeConfig",
    "RecipeError",
    "ModelSection",
    "DataSection",
    "OptimizerSection",
    "ScheduleSection",
    "TrainerSection",
    "FP4Section",
    "FP4Overrides",
    "fp4_config_from_spec",
    "load_recipe",
    "recipe_to_dict",
    "flat_recipe_dict",
    "recipe_to_yaml",
    "recipe_from_dict",
    "STRATEGIES",
    "ACCELERATORS",
    "OPTIMIZER_STATES",
    "GRAD_COMM",
    "WIRE_FORMAT",
]

STRATEGIES = ("auto", "ddp", "fsdp")
#: ``trainer.accelerator``: Lightning's names for the devices fp4lightning runs on ("gpu" = "cuda"); Lightning's
#: others (tpu, mps) are not supported
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
#: ``optimizer.states``: AdamW's moments. ``fp32`` is torch's AdamW; the others are
#: ``fp4lightning.lightning.optim.LowPrecisionAdamW`` with a per-tensor scale per moment: ``fp16`` both moments in FP16
#: (the paper's text, arXiv 2501.17116 section 4), ``fp8-fp16`` an E4M3 first and an FP16 second moment (its
#: released code's MS-AMP level O2)
OPTIMIZER_STATES = ("fp32", "fp16", "fp8-fp16")
#: ``trainer.grad_comm``: the format data-parallel gradients travel in -> its name in fp4lightning.distributed.comm
#: (``FP4DDPStrategy(grad_format=...)``); one device applies the same quantize-dequantize round trip
#: (fp4lightning.distributed.grad_comm_sim)
WIRE_FORMAT = {"fp32": "fp32", "bf16": "bf16", "fp8-e4m3": "e4m3", "fp8-e5m2": "e5m2"}
GRAD_COMM = tuple(WIRE_FORMAT)
#: what FSDP's reduce-scatter takes (fp4lightning.distributed.fsdp.FP8ReduceScatter; FSDP2 reduces fp32 itself)
FSDP_GRAD_COMM = ("fp32", "fp8-e4m3", "fp8-e5m2")


class RecipeError(UsageError):
    """A recipe or override is invalid; the message names the dotted key."""


@dataclass(frozen=True)
class ModelSection:
    """A named LLaMA config plus per-field overrides (``None`` keeps the named value)."""

    name: str = "tiny"
    vocab_size: Optional[int] = None
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    max_seq_len: Optional[int] = None
    rope_theta: Optional[float] = None
    norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    init_std: Optional[float] = None

    def to_llama_config(self) -> LlamaConfig:
        overrides = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        base = LLAMA_CONFIGS[self.name]
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class DataSection:
    source: str = "builtin"
    dir: str = "data/builtin"
    vocab_size: int = 4096
    val_fraction: float = 0.02
    max_tokens: Optional[int] = None
    text_key: str = "text"
    seq_len: int = 256
    micro_batch_size: int = 16
    global_batch_size: int = 16
    val_batches: int = 4
    num_workers: int = 0


@dataclass(frozen=True)
class OptimizerSection:
    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    states: str = "fp32"


@dataclass(frozen=True)
class ScheduleSection:
    max_steps: int = 150
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    max_tokens: Optional[int] = None


@dataclass(frozen=True)
class TrainerSection:
    precision: str = "fp4"
    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    val_every_n_steps: int = 50
    log_every_n_steps: int = 5
    checkpoint_every_n_steps: int = 50
    num_threads: Optional[int] = None
    max_nonfinite_skips: int = 20
    loggers: str = "csv,tensorboard"
    peak_tflops: Optional[float] = None
    grad_comm: str = "fp32"
    #: torch.compile each decoder block (fp4lightning.models.llama.compile_blocks; the FP4 layers are one
    #: graph break each); with fsdp the blocks are compiled before they are sharded. On CPU it costs a
    #: minute or more of compiling at the first step (and again at the first validation, no_grad)
    compile: bool = False
    #: with compile: torch's activation_memory_budget (0-1) while the blocks compile; lower saves fewer
    #: activations and recomputes more of the work between the FP4 layers' graph breaks (docs/perf.md)
    compile_memory_budget: Optional[float] = None


def _overrides_schema() -> type:
    """``FP4Overrides``: one optional field per :class:`~fp4lightning.config.FP4Config` field, same
    type (tuples as lists, which YAML writes); ``None`` keeps the preset's value. Generated from
    ``FP4Config`` so that a new knob is a recipe key at once, typed and checked by the schema."""
    types = {"bool": bool, "int": int, "float": float, "str": str, "tuple[str, ...]": List[str]}
    fields = []
    for f in dataclasses.fields(FP4Config):
        t = types.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if t is None:  # pragma: no cover - a new FP4Config field type must be added to the table above
            raise TypeError(f"FP4Config.{f.name}: type {f.type} has no recipe equivalent")
        fields.append((f.name, Optional[t], field(default=None)))
    cls = dataclasses.make_dataclass("FP4Overrides", fields, frozen=True)
    cls.__module__ = __name__
    return cls


FP4Overrides = _overrides_schema()


@dataclass(frozen=True)
class FP4Section:
    """The FP4 recipe: a preset of :data:`fp4lightning.config.PRESETS` plus typed per-field overrides."""

    preset: str = "paper"
    overrides: FP4Overrides = field(default_factory=FP4Overrides)  # type: ignore[valid-type]

    def changes(self) -> dict[str, Any]:
        """The overrides that are set (``{field: value}``)."""
        return {k: v for k, v in dataclasses.asdict(self.overrides).items() if v is not None}

    def spec(self) -> dict[str, Any]:
        """``{"preset": ..., "overrides": {...}}``: what checkpoints record (:func:`fp4_config_from_spec`)."""
        return {"preset": self.preset, "overrides": self.changes()}


def fp4_config_from_spec(spec: dict[str, Any]) -> FP4Config:
    """The :class:`FP4Config` of a recorded spec ``{"preset": name, "overrides": {field: value}}``."""
    return FP4Config.from_preset(spec["preset"], **dict(spec.get("overrides") or {}))


@dataclass(frozen=True)
class InitSection:
    from_hf: Optional[str] = None
    from_checkpoint: Optional[str] = None


@dataclass(frozen=True)
class RecipeConfig:
    """A whole training run. ``out_dir`` defaults to ``runs/<name>``."""

    name: str = "tiny"
    out_dir: str = "runs/${name}"
    seed: int = 1234
    ckpt_path: Optional[str] = None
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    fp4: FP4Section = field(default_factory=FP4Section)
    init: InitSection = field(default_factory=InitSection)

    @property
    def world_size(self) -> int:
        return self.trainer.devices * self.trainer.num_nodes

    @property
    def accumulate_grad_batches(self) -> int:
        return self.data.global_batch_size // (self.data.micro_batch_size * self.world_size)

    def llama_config(self) -> LlamaConfig:
        return self.model.to_llama_config()

    @functools.cached_property
    def fp4_config(self) -> FP4Config:
        """The :class:`FP4Config` of the ``fp4`` section, built once (checked by :func:`load_recipe`)."""
        return fp4_config_from_spec(self.fp4.spec())


# ----------------------------------------------------------------------------- loading
def _section_keys(dotted: str) -> list[str]:
    """Valid keys in the section that holds ``dotted`` (for 'did you mean')."""
    obj: Any = RecipeConfig()
    for part in dotted.split(".")[:-1]:
        obj = getattr(obj, part, None)
    return [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []


def _field_type(dotted: str) -> str | None:
    obj: Any = RecipeConfig()
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part, None)
    if not dataclasses.is_dataclass(obj):
        return None
    hint = typing.get_type_hints(type(obj)).get(leaf)
    return None if hint is None else _type_name(hint)


def _type_name(hint: Any) -> str:
    """``Optional[float]`` -> ``float``, ``Optional[List[str]]`` -> ``list of str``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return _type_name(args[0])
    if typing.get_origin(hint) in (list, List):
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(hint, "__name__", str(hint))


def _refuse_non_bool(layer: Any, origin: str, schema: Any = None, prefix: str = "") -> None:
    """YAML ``0``/``1`` for a boolean key: OmegaConf would take it as False/True; refused, so that a
    typo (``fp4.overrides.dge=0`` meant for another key) is not silently a switch."""
    from omegaconf import OmegaConf

    schema = RecipeConfig if schema is None else schema
    container = OmegaConf.to_container(layer, resolve=False) if OmegaConf.is_config(layer) else layer
    if not isinstance(container, dict) or not dataclasses.is_dataclass(schema):
        return
    hints = typing.get_type_hints(schema)
    for k, v in container.items():
        hint = hints.get(k)
        if hint is None:
            continue  # unknown keys are reported by the merge, with 'did you mean'
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        base = inner[0] if typing.get_origin(hint) is typing.Union and len(inner) == 1 else hint
        if dataclasses.is_dataclass(base):
            _refuse_non_bool(v, origin, base, f"{prefix}{k}.")
        elif base is bool and v is not None and not isinstance(v, bool):
            raise RecipeError(f"recipe key `{prefix}{k}` ({origin}) expects bool (true or false), got {v!r}")


def _omegaconf_error(e: Exception, origin: str) -> RecipeError:
    from omegaconf.errors import ConfigKeyError

    key = getattr(e, "full_key", None)
    msg = str(getattr(e, "msg", None) or e).splitlines()[0]
    if isinstance(e, ConfigKeyError) and key:
        valid = _section_keys(key)
        leaf = key.split(".")[-1]
        hint = difflib.get_close_matches(leaf, valid, n=1)
        section = key.rsplit(".", 1)[0] if "." in key else "the top level"
        text = f"unknown recipe key `{key}` ({origin})"
        if hint:
            text += f"; did you mean `{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{hint[0]}`?"
        return RecipeError(f"{text}\nvalid keys in {section}: {', '.join(valid)}")
    if key:
        expected = _field_type(key)
        return RecipeError(f"recipe key `{key}` ({origin}){f' expects {expected}' if expected else ''}: {msg}")
    return RecipeError(f"invalid recipe ({origin}): {msg}")


def _check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise RecipeError(f"recipe key `{key}` = {value!r} is not valid; choose one of: {', '.join(choices)}")


def _positive(key: str, value: Any, zero_ok: bool = False) -> None:
    # `not value >= 0` also catches NaN, which compares false with everything
    if value is not None and (not math.isfinite(value) or not value >= 0 or (value == 0 and not zero_ok)):
        raise RecipeError(f"recipe key `{key}` must be {'>= 0' if zero_ok else '> 0'} and finite, got {value}")


def _in_range(key: str, value: Any, lo: float, hi: float, hi_open: bool = True) -> None:
    ok = math.isfinite(value) and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        raise RecipeError(f"recipe key `{key}` must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}, got {value}")


def _validate(cfg: RecipeConfig) -> None:
    """Every check of a merged recipe, the first failing one raising :class:`RecipeError`."""
    _validate_choices(cfg)
    _validate_extras(cfg)
    _validate_ranges(cfg)
    _validate_consistency(cfg)


def _validate_choices(cfg: RecipeConfig) -> None:
    """Keys with a fixed set of values, and the pairs of them that do not work together."""
    _check_choice("model.name", cfg.model.name, sorted(LLAMA_CONFIGS))
    if cfg.trainer.precision in REFUSED_PRECISIONS:
        raise RecipeError(f"recipe key `trainer.precision` = {cfg.trainer.precision!r} is not supported: "
                          f"{REFUSED_PRECISIONS[cfg.trainer.precision]}; choose one of: {', '.join(RECIPE_PRECISIONS)}")
    _check_choice("trainer.precision", cfg.trainer.precision, RECIPE_PRECISIONS)
    _check_choice("trainer.accelerator", cfg.trainer.accelerator, ACCELERATORS)
    _check_choice("trainer.strategy", cfg.trainer.strategy, STRATEGIES)
    if cfg.trainer.strategy == "fsdp" and cfg.trainer.precision not in FSDP_PRECISIONS:
        raise RecipeError(f"recipe key `trainer.precision` = {cfg.trainer.precision!r} does not work with "
                          "`trainer.strategy` = 'fsdp' (Lightning's FSDP2 strategy takes no fp16 autocast or fp64); "
                          f"choose one of: {', '.join(FSDP_PRECISIONS)}, or trainer.strategy=ddp")
    _check_choice("fp4.preset", cfg.fp4.preset, list(PRESETS))
    _check_choice("optimizer.states", cfg.optimizer.states, OPTIMIZER_STATES)
    _check_choice("trainer.grad_comm", cfg.trainer.grad_comm, GRAD_COMM)
    if cfg.trainer.strategy == "fsdp" and cfg.trainer.grad_comm not in FSDP_GRAD_COMM:
        raise RecipeError(f"recipe key `trainer.grad_comm` = {cfg.trainer.grad_comm!r} does not work with "
                          "`trainer.strategy` = 'fsdp' (its reduce-scatter runs in fp32 or FP8); choose one of: "
                          f"{', '.join(FSDP_GRAD_COMM)}, or trainer.strategy=ddp")


def _validate_ranges(cfg: RecipeConfig) -> None:
    """Numbers within their ranges (counts positive, fractions in [0, 1), ...)."""
    for section in ("model", "data", "schedule", "trainer"):
        for f in dataclasses.fields(getattr(cfg, section)):
            v = getattr(getattr(cfg, section), f.name)
            if isinstance(v, int) and not isinstance(v, bool) and f.name not in ("num_workers",):
                _positive(f"{section}.{f.name}", v)
    _positive("data.num_workers", cfg.data.num_workers, zero_ok=True)
    _positive("optimizer.lr", cfg.optimizer.lr)
    _positive("optimizer.weight_decay", cfg.optimizer.weight_decay, zero_ok=True)
    _positive("optimizer.grad_clip", cfg.optimizer.grad_clip, zero_ok=True)
    _positive("optimizer.eps", cfg.optimizer.eps)
    _in_range("optimizer.beta1", cfg.optimizer.beta1, 0.0, 1.0)
    _in_range("optimizer.beta2", cfg.optimizer.beta2, 0.0, 1.0)
    _in_range("seed", cfg.seed, 0, 2**32 - 1, hi_open=False)  # numpy / Lightning seeds are 32-bit
    if cfg.trainer.compile_memory_budget is not None:
        _in_range("trainer.compile_memory_budget", cfg.trainer.compile_memory_budget, 0.0, 1.0, hi_open=False)
    for name in ("rope_theta", "norm_eps", "init_std"):
        _positive(f"model.{name}", getattr(cfg.model, name))
    for key in ("data.val_fraction", "schedule.warmup_fraction", "schedule.min_lr_ratio"):
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if not 0.0 <= v < 1.0 or (key == "data.val_fraction" and v == 0.0):  # also refuses NaN
            raise RecipeError(f"recipe key `{key}` must be in {'(0, 1)' if key == 'data.val_fraction' else '[0, 1)'}, got {v}")


def _validate_consistency(cfg: RecipeConfig) -> None:
    """Keys that must agree with each other: the model builds and fits ``data.seq_len``, the batch sizes
    divide, the FP4 overrides make an :class:`FP4Config`."""
    try:
        llama = cfg.llama_config()
    except (ValueError, TypeError) as e:
        raise RecipeError(f"recipe section `model`: {e}") from e
    if cfg.data.seq_len > llama.max_seq_len:
        raise RecipeError(
            f"recipe key `data.seq_len` = {cfg.data.seq_len} exceeds the model's max_seq_len "
            f"{llama.max_seq_len}; lower it or set `model.max_seq_len`"
        )
    per_step = cfg.data.micro_batch_size * cfg.world_size
    if cfg.data.global_batch_size % per_step:
        raise RecipeError(
            f"recipe key `data.global_batch_size` = {cfg.data.global_batch_size} must be a multiple of "
            f"`data.micro_batch_size` x `trainer.devices` x `trainer.num_nodes` = {per_step} "
            "(the rest is gradient accumulation)"
        )
    try:
        cfg.fp4_config  # built once here; pretraining, the plugin and the LightningModule use this object
    except (ValueError, TypeError) as e:
        raise RecipeError(f"recipe key `fp4.overrides`: {e}") from e


_ENV_INTERPOLATION = re.compile(r"\$\{\s*oc\.(env|decode)\s*:")


def _refuse_env_interpolation(layer: Any, origin: str, prefix: str = "") -> None:
    """``${oc.env:VAR}`` would copy an environment variable (a token, a password) into config.yaml,
    the loggers' hparams and every checkpoint; recipes are shared, so it is refused."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(layer, resolve=False) if OmegaConf.is_config(layer) else layer
    items = container.items() if isinstance(container, dict) else enumerate(container or [])
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            _refuse_env_interpolation(v, origin, key + ".")
        elif isinstance(v, str) and _ENV_INTERPOLATION.search(v):
            raise RecipeError(f"recipe key `{key}` ({origin}) reads an environment variable ({v}); environment "
                              "interpolation is not allowed in recipes (the value would be saved in config.yaml and "
                              "checkpoints): write the value itself, or pass it as an override key=value")


#: recipe ``trainer.loggers`` entries
LOGGERS = ("csv", "tensorboard", "wandb")


def _validate_extras(cfg: RecipeConfig) -> None:
    """The keys for token budgets, loggers, throughput and initial weights."""
    _positive("schedule.max_tokens", cfg.schedule.max_tokens)
    _positive("trainer.peak_tflops", cfg.trainer.peak_tflops)
    names = [n.strip() for n in cfg.trainer.loggers.split(",") if n.strip()]
    for n in names:
        _check_choice("trainer.loggers", n, LOGGERS)
    if "wandb" in names:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise RecipeError("recipe key `trainer.loggers` includes wandb, which is not installed; "
                              "pip install wandb, or use csv,tensorboard")
    if cfg.init.from_hf and cfg.init.from_checkpoint:
        raise RecipeError("recipe keys `init.from_hf` and `init.from_checkpoint` are exclusive; set one")


def _resolve_token_budget(cfg: RecipeConfig) -> RecipeConfig:
    """``schedule.max_tokens`` set: ``schedule.max_steps`` becomes the steps that consume it (rounded up)."""
    if cfg.schedule.max_tokens is None:
        return cfg
    per_step = cfg.data.global_batch_size * cfg.data.seq_len
    steps = -(-cfg.schedule.max_tokens // per_step)
    return dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, max_steps=steps))


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Merge the schema defaults, the YAML at ``path`` (optional) and ``key=value`` overrides.

    Raises :class:`RecipeError` naming the file or the dotted key on any problem.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [OmegaConf.structured(RecipeConfig)]
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file {path} not found")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:
            raise RecipeError(f"recipe file {path} is not valid YAML: {e}") from e
        if not OmegaConf.is_dict(loaded):
            raise RecipeError(f"recipe file {path} must be a mapping of sections (model:, data:, ...)")
        layers.append((loaded, f"in {path}"))
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise RecipeError(f"overrides must look like key=value (e.g. schedule.max_steps=100); got {bad}")
    for o in overrides:
        try:  # YAML tags (!!python/...) and aliases (*x) are never executed; say so in one line
            layers.append((OmegaConf.from_dotlist([o]), "on the command line"))
        except Exception as e:  # yaml's ConstructorError / ComposerError / ScannerError, OmegaConf's errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RecipeError(f"override {o!r} cannot be parsed ({first}); YAML tags and aliases are not allowed, "
                              "quote the value if it is a string") from None
    for layer, origin in layers[1:]:
        _refuse_env_interpolation(layer, origin)
        _refuse_non_bool(layer, origin)
    merged = layers[0]
    for layer, origin in layers[1:]:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, origin) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, "while resolving") from None
    _validate(cfg)
    resolved = _resolve_token_budget(cfg)
    if resolved is not cfg:
        resolved.__dict__["fp4_config"] = cfg.fp4_config  # the one FP4Config, validated above
    return resolved


def recipe_to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    """Plain nested dict (for checkpoints and loggers); ``fp4.overrides`` lists only the keys set."""
    d = dataclasses.asdict(cfg)
    d["fp4"]["overrides"] = cfg.fp4.changes()
    return d


def flat_recipe_dict(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested recipe dict (``recipe_to_dict``, or one a checkpoint saved) as ``{dotted key: value}``;
    an empty section (no ``fp4.overrides``) records nothing."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_recipe_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_to_yaml(recipe: RecipeConfig | dict[str, Any]) -> str:
    """The resolved recipe as YAML (printed and saved beside the checkpoints): of the typed recipe, or of
    the dict :func:`recipe_to_dict` made of it (what a run records, serialised once)."""
    from omegaconf import OmegaConf

    d = recipe_to_dict(recipe) if isinstance(recipe, RecipeConfig) else recipe
    return OmegaConf.to_yaml(OmegaConf.create(d))


def recipe_from_dict(d: dict[str, Any]) -> RecipeConfig:
    """Rebuild a :class:`RecipeConfig` from :func:`recipe_to_dict` output (e.g. a checkpoint's)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.create(d)))
    except Exception as e:
        raise RecipeError(f"stored recipe does not match this version's schema: {e}") from e
