"""Recipe schema: every shipped recipe parses and documents every key; the paper-scale
recipes build on the meta device; bad keys, types and choices fail naming the dotted key."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fp4lightning.train.recipe import RecipeConfig, RecipeError, load_recipe, recipe_from_dict, recipe_to_dict
from fp4lightning.train.run import make_module, precision_setup

RECIPES = sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml"))
PAPER = {"llama2-1.3b": 32, "llama2-7b": 64, "llama2-13b": 128}  # recipe -> gradient accumulation


def test_recipes_are_shipped():
    assert {p.stem for p in RECIPES} >= {"tiny", *PAPER}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses(path):
    cfg = load_recipe(path)
    assert isinstance(cfg, RecipeConfig)
    assert cfg.out_dir == f"runs/{cfg.name}"  # interpolation resolved
    assert recipe_from_dict(recipe_to_dict(cfg)) == cfg  # what checkpoints store round-trips


def test_tiny_is_the_embedded_default():
    assert load_recipe(Path(__file__).parents[1] / "recipes" / "tiny.yaml") == load_recipe()


def _schema_fields() -> dict[str, dataclasses.Field]:
    out = {}
    for f in dataclasses.fields(RecipeConfig):
        if dataclasses.is_dataclass(f.default_factory() if callable(f.default_factory) else None):
            for g in dataclasses.fields(f.default_factory()):
                out[f"{f.name}.{g.name}"] = g
        else:
            out[f.name] = f
    return out


def _render_default(f: dataclasses.Field) -> str:
    v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if dataclasses.is_dataclass(v) and not any(dataclasses.asdict(v).values()):
        return "{}"  # fp4.overrides: nothing overridden
    return "{}" if isinstance(v, dict) else str(v)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_key_has_a_type_and_default_comment(path):
    fields = _schema_fields()
    lines = path.read_text().splitlines()
    seen, section = set(), None
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_]\w*):", line)
        if not m:
            continue
        indent, key = m.groups()
        if not indent and line.rstrip().endswith(":"):
            section = key
            continue
        dotted = f"{section}.{key}" if indent else key
        if not indent:
            section = None
        assert dotted in fields, f"{path.name}:{i + 1}: {dotted} is not in the schema"
        comment = lines[i - 1].strip()
        c = re.search(r"\(type: (.+), default: (.*)\)$", comment)
        assert comment.startswith("#") and c, f"{path.name}:{i + 1}: no '(type: ..., default: ...)' comment above {dotted}"
        f = fields[dotted]
        assert c.group(1) == str(f.type), f"{path.name}: {dotted} documented as {c.group(1)}, schema says {f.type}"
        assert c.group(2) == _render_default(f), f"{path.name}: {dotted} default documented as {c.group(2)}"
        seen.add(dotted)
    assert seen == set(fields), f"{path.name} does not spell out {sorted(set(fields) - seen)}"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipes_build_on_meta_device(name):
    cfg = load_recipe(Path(__file__).parents[1] / "recipes" / f"{name}.yaml")
    # the paper's settings (arXiv 2501.17116, section 7)
    assert cfg.data.seq_len == 2048 and cfg.data.global_batch_size * cfg.data.seq_len == 2048 * 2048
    assert cfg.data.source.startswith("hf:") and "dclm" in cfg.data.source
    assert (cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.weight_decay) == (3e-4, 0.9, 0.95, 0.1)
    assert (cfg.schedule.warmup_fraction, cfg.schedule.min_lr_ratio) == (0.05, 0.1)
    assert cfg.trainer.precision == "fp4" and cfg.fp4.preset == "paper"
    assert cfg.trainer.strategy == ("ddp" if name == "llama2-1.3b" else "fsdp")
    assert cfg.accumulate_grad_batches == PAPER[name]
    # the LightningModule builds (and FP4-converts) the model on the meta device: no memory
    precision = precision_setup(cfg)
    module = make_module(cfg, precision)
    if not precision.convert_in_module:  # DDP: the FP4Precision plugin converts the model
        (plugin,) = precision.plugins
    with torch.device("meta"):
        module.configure_model()
        if not precision.convert_in_module:
            plugin.convert_module(module.model)
    params = list(module.model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == cfg.llama_config().num_params()
    from fp4lightning.nn.linear import FP4Linear

    n_fp4 = sum(isinstance(m, FP4Linear) for m in module.model.modules())
    assert n_fp4 == 7 * cfg.llama_config().n_layers  # q, k, v, o, gate, up, down; lm_head stays high precision
    assert not isinstance(module.model.lm_head, FP4Linear)


def test_overrides_win_over_the_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("name: mine\nschedule:\n  max_steps: 7\nfp4:\n  preset: fp4-no-occ\n")
    cfg = load_recipe(f, ["schedule.max_steps=9", "fp4.overrides.occ_alpha=0.999", "model.n_kv_heads=1"])
    assert (cfg.name, cfg.out_dir, cfg.schedule.max_steps) == ("mine", "runs/mine", 9)
    assert cfg.fp4.preset == "fp4-no-occ" and cfg.fp4.changes() == {"occ_alpha": 0.999}
    assert cfg.llama_config().kv_heads == 1


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (["model.n_layer=3"], r"unknown recipe key `model\.n_layer`.*did you mean `model\.n_layers`"),
        (["trainer.precison=fp4"], r"`trainer\.precison`.*valid keys in trainer: .*precision"),
        (["schedule.max_steps=ten"], r"`schedule\.max_steps`.*expects int"),
        (["optimizer.lr=fast"], r"`optimizer\.lr`.*expects float"),
        (["trainer.precision=fp8"], r"`trainer\.precision` = 'fp8'.*choose one of: fp4, fp4-bf16, fp4-fp16, bf16-mixed, bf16-true, 16-mixed, 32-true"),
        # pure fp16 weights + AdamW: eps=1e-8 underflows to 0 in fp16 and the first step writes NaN weights
        (["trainer.precision=16-true"], r"`trainer\.precision` = '16-true'.*fp16.*choose one of: .*fp4-fp16.*16-mixed.*32-true"),
        # Lightning would accept tpu / mps, fail after the data is loaded; foo is a Lightning traceback
        (["trainer.accelerator=foo"], r"`trainer\.accelerator` = 'foo'.*choose one of: auto, cpu, gpu, cuda"),
        (["trainer.accelerator=tpu"], r"`trainer\.accelerator` = 'tpu'.*choose one of: auto, cpu, gpu, cuda"),
        # Lightning's ModelParallelStrategy (FSDP2) takes 32-true, bf16-mixed, bf16-true (and 16-true) only
        (["trainer.strategy=fsdp", "trainer.precision=fp4-fp16"],
         r"`trainer\.precision` = 'fp4-fp16' does not work with `trainer\.strategy` = 'fsdp'.*fp4, fp4-bf16, bf16-mixed, bf16-true, 32-true"),
        (["trainer.strategy=fsdp", "trainer.precision=16-mixed"], r"`trainer\.precision` = '16-mixed' does not work"),
        (["trainer.strategy=fsdp", "trainer.precision=64-true"], r"`trainer\.precision` = '64-true' does not work"),
        (["model.name=llama2-70b"], r"`model\.name`.*llama2-13b.*tiny"),
        (["fp4.preset=nvfp8"], r"`fp4\.preset`.*paper, w4a4-direct, fp4-no-dge, fp4-no-occ"),
        (["fp4.overrides.occ_alhpa=0.9"], r"`fp4\.overrides\.occ_alhpa`.*occ_alpha"),
        # fp4.overrides is typed field by field from FP4Config (issue 14)
        (["fp4.overrides.occ_alpha=abc"], r"`fp4\.overrides\.occ_alpha`.*expects float"),
        (["fp4.overrides.dge=0"], r"`fp4\.overrides\.dge`.*expects bool"),
        (["fp4.overrides.occ_sample_size=many"], r"`fp4\.overrides\.occ_sample_size`.*expects int"),
        (["fp4.overrides.occ_alpha=0.3"], r"`fp4\.overrides`.*occ_alpha must be in \(0\.5, 1\)"),
        (["trainer.strategy=deepspeed"], r"`trainer\.strategy`.*auto, ddp, fsdp"),
        (["optimizer.states=fp8"], r"`optimizer\.states` = 'fp8' is not valid; choose one of: fp32, fp16, fp8-fp16"),
        (["trainer.grad_comm=e4m3"], r"`trainer\.grad_comm` = 'e4m3'.*fp32, bf16, fp8-e4m3, fp8-e5m2"),
        # FSDP's reduce-scatter runs in fp32 (FSDP2's own) or FP8 (fp4lightning.distributed.fsdp.FP8ReduceScatter)
        (["trainer.strategy=fsdp", "trainer.grad_comm=bf16"],
         r"`trainer\.grad_comm` = 'bf16' does not work with `trainer\.strategy` = 'fsdp'.*fp32, fp8-e4m3, fp8-e5m2"),
        (["data.global_batch_size=24"], r"`data\.global_batch_size` = 24 must be a multiple"),
        (["data.seq_len=4096"], r"`data\.seq_len` = 4096 exceeds"),
        (["schedule.max_steps=0"], r"`schedule\.max_steps` must be > 0"),
        (["max_steps"], r"key=value"),
    ],
)
def test_bad_overrides_name_the_key(overrides, pattern):
    with pytest.raises(RecipeError, match=f"(?s){pattern}"):
        load_recipe(None, overrides)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_comments_list_every_choice(path):
    """The comments above trainer.precision / trainer.accelerator / trainer.strategy / fp4.preset /
    optimizer.states / trainer.grad_comm name every choice the schema accepts, and nothing it refuses; so
    does the README's list of presets."""
    from fp4lightning.config import PRESETS
    from fp4lightning.lightning.precision_names import RECIPE_PRECISIONS
    from fp4lightning.train.recipe import ACCELERATORS, GRAD_COMM, OPTIMIZER_STATES, STRATEGIES

    lines = path.read_text().splitlines()

    def comment(key: str) -> str:
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        return lines[i - 1]

    for key, choices in (("precision", RECIPE_PRECISIONS), ("accelerator", ACCELERATORS),
                         ("strategy", STRATEGIES), ("preset", list(PRESETS)), ("states", OPTIMIZER_STATES),
                         ("grad_comm", GRAD_COMM)):
        words = set(re.findall(r"[\w.-]+", comment(key).split("(type:")[0]))
        assert set(choices) <= words, f"{path.name}: the {key} comment misses {sorted(set(choices) - words)}"
    assert "16-true" not in re.findall(r"[\w.-]+", comment("precision"))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    listed = re.search(r"Presets are (.*?)\. Every knob", readme, re.S).group(1)
    assert set(PRESETS) <= set(re.findall(r"`([\w-]+)`", listed)), listed


def test_fp4_section_builds_one_typed_config():
    cfg = load_recipe(None, ["fp4.preset=fp4-no-occ", "fp4.overrides.dge_k=4", "fp4.overrides.skip_modules=[lm_head]",
                             "schedule.max_tokens=100000"])
    assert cfg.fp4.changes() == {"dge_k": 4.0, "skip_modules": ["lm_head"]}
    assert cfg.fp4_config is cfg.fp4_config  # built once
    assert (cfg.fp4_config.occ, cfg.fp4_config.dge_k, cfg.fp4_config.skip_modules) == (False, 4.0, ("lm_head",))
    # what checkpoints record: only the keys set
    assert recipe_to_dict(cfg)["fp4"] == {"preset": "fp4-no-occ", "overrides": {"dge_k": 4.0, "skip_modules": ["lm_head"]}}


def test_bad_recipe_files(tmp_path):
    with pytest.raises(RecipeError, match="recipe file .*missing.yaml not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: tiny\n  n_layer: 2\n")
    with pytest.raises(RecipeError, match=r"(?s)`model\.n_layer` \(in .*bad\.yaml\).*model\.n_layers"):
        load_recipe(bad)
    bad.write_text("trainer:\n  devices: two\n")
    with pytest.raises(RecipeError, match=r"`trainer\.devices` \(in .*bad\.yaml\) expects int"):
        load_recipe(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(bad)
