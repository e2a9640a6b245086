"""The ``fp4lightning`` command line: argument parsing and dispatch, nothing else.

Every subcommand is a :class:`Command`: a one-line help, a function adding its arguments and
a ``run(args) -> int``. The parser is built from this light module only, so
``fp4lightning --help`` and every subcommand's ``--help`` return without importing torch or
Lightning; a command's heavy modules are imported inside its ``run``.

Errors follow :mod:`fp4lightning.errors`: a user error prints one line and exits 2, anything
else is a bug and keeps its traceback. ``fp4lightning train`` also exits 143 after SIGTERM
(checkpoint saved, resumable) and 3 when training stopped on non-finite steps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp4lightning.errors import UsageError, check_writable_dir, run_command

__all__ = ["Command", "COMMANDS", "main", "build_parser", "EXIT_PREEMPTED", "EXIT_NONFINITE"]

#: exit status of `fp4lightning train` after SIGTERM (checkpoint saved; 128 + SIGTERM, as a shell reports it)
EXIT_PREEMPTED = 143
#: exit status when training stopped on non-finite steps (fp4lightning.lightning.nonfinite)
EXIT_NONFINITE = 3


# ----------------------------------------------------------------------------- shared argument helpers
def _add_recipe_arguments(parser: argparse.ArgumentParser, overrides_help: str) -> None:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe YAML (default: the built-in tiny recipe, same as recipes/tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)


def _recipe_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """``RECIPE key=value...`` -> (recipe or None, overrides); ``fp4lightning train key=value`` has no recipe."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        recipe, overrides = None, [recipe, *overrides]
    return recipe, overrides


# ----------------------------------------------------------------------------- data
def _data_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="download/read, tokenise and shard a corpus (idempotent)",
                       description="Train a byte-level BPE on the corpus and write train/val token shards. "
                                   "A second run with the same arguments reuses what is there.")
    p.add_argument("--source", default=None,
                   help="builtin (default), a local file/folder of .txt/.md/.rst/.jsonl/.parquet, or hf:NAME[:CONFIG]")
    p.add_argument("--out", default=None, help="output folder (default: data/builtin, data/<name>)")
    p.add_argument("--recipe", default=None,
                   help="take source, folder, vocabulary size, val fraction and token cap from a recipe's data section")
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary (default 4096)")
    p.add_argument("--val-fraction", type=float, default=None, help="share of documents held out (default 0.02)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens (hf: corpora)")
    p.add_argument("--text-key", default=None, help="JSONL field / Parquet column / dataset field (default text)")
    p.add_argument("--cache-dir", default=None, help="where downloads are kept (default: <out>/../downloads)")
    p.add_argument("--force", action="store_true", help="prepare again even if up to date")
    p.add_argument("--on-bad-record", choices=("error", "skip"), default="error",
                   help="a record that is not text (bad UTF-8 in .jsonl, a non-string or null field, a binary file): "
                        "stop with its file and line (error, default) or drop it and count it (skip)")


def _data_run(args: argparse.Namespace) -> int:
    opts = {"source": "builtin", "out": None, "vocab_size": 4096, "val_fraction": 0.02, "max_tokens": None,
            "text_key": "text"}
    if args.recipe is not None:  # checked before the heavy imports below
        from fp4lightning.train.recipe import load_recipe

        d = load_recipe(args.recipe).data
        opts.update(source=d.source, out=d.dir, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                    max_tokens=d.max_tokens, text_key=d.text_key)
    from fp4lightning.data import prepare
    from fp4lightning.eval.tasks import build_offline_tasks

    for key in opts:
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    out = prepare(source=opts["source"], out_dir=opts["out"], vocab_size=opts["vocab_size"],
                  val_fraction=opts["val_fraction"], max_tokens=opts["max_tokens"], text_key=opts["text_key"],
                  cache_dir=args.cache_dir, force=args.force, on_bad_record=args.on_bad_record,
                  # the offline zero-shot tasks from the held-out split (docs/evaluation.md), written while the
                  # folder is locked; too little text warns
                  then=lambda folder: build_offline_tasks(folder, strict=False))
    return 0


# ----------------------------------------------------------------------------- train
def _train_arguments(parser: argparse.ArgumentParser) -> None:
    _add_recipe_arguments(parser, "recipe overrides, e.g. schedule.max_steps=50 trainer.precision=bf16-mixed")
    parser.add_argument("--resume", action="store_true",
                        help="continue from <out_dir>/checkpoints/last.ckpt, or the newest step=N.ckpt that loads "
                             "(same as ckpt_path=last); refused if the model, the data order (data.dir, seq_len, "
                             "batch sizes, devices, seed) or the data's tokenizer changed")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an out_dir that holds an earlier run, deleting its checkpoints, logs "
                             "and loss.png (without it such a run is refused); a run still training there is never "
                             "touched: its folder is locked")
    parser.add_argument("--verify-data", action="store_true",
                        help="check every data shard against the sha256 recorded by `data prepare` before training "
                             "(sizes are always checked)")


def _train_run(args: argparse.Namespace) -> int:
    from fp4lightning.train.preflight import check_recipe_inputs
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.run_lock import check_not_in_use

    recipe, overrides = _recipe_and_overrides(args)
    cfg = load_recipe(recipe, overrides)  # before torch and Lightning: a recipe mistake is reported at once
    check_recipe_inputs(cfg)  # and so are missing data or checkpoints
    check_not_in_use(cfg.out_dir)  # and an out_dir another run is training in (train() then locks it)
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from fp4lightning.lightning.nonfinite import NonFiniteError
    from fp4lightning.train.run import train

    try:
        train(cfg, resume=args.resume, verify_data=args.verify_data, overwrite=args.overwrite,
              argv=[*([recipe] if recipe else []), *overrides])
    except SIGTERMException:
        return EXIT_PREEMPTED  # saved and resumable, but not finished: a scheduler must see the difference
    except NonFiniteError as e:
        print(f"fp4lightning train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    return 0


# ----------------------------------------------------------------------------- export-hf / import-hf
def _export_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT", help="a .ckpt file or a run folder (runs/<name>)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (config.json, model.safetensors, tokenizer); "
                        "written beside it and renamed into place when complete")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if it holds files (without it such a folder is refused)")
    parser.add_argument("--format", choices=("fp32", "nvfp4"), default="fp32",
                        help="fp32: the high-precision master weights (default); nvfp4: the FP4 layers as "
                             "compressed-tensors NVFP4 (the codes and scales the nvfp4 preset's forward used; vLLM "
                             "and transformers load it), the rest bf16")
    parser.add_argument("--requantize", action="store_true",
                        help="with --format nvfp4, a run of another preset (or in high precision): re-quantize the "
                             "weights its forward used to NVFP4 and print the weight SQNR (without it: refused)")


def _export_hf_run(args: argparse.Namespace) -> int:
    from fp4lightning.models.export_folder import check_export_target
    from fp4lightning.train.preflight import check_checkpoint_path

    if args.requantize and args.format != "nvfp4":
        raise UsageError("--requantize goes with --format nvfp4 (--format fp32 writes the master weights as they are)")
    check_export_target(args.out_dir, args.overwrite)  # an OUT_DIR that holds files (or cannot be written) first
    check_checkpoint_path(args.ckpt, "CKPT")  # before torch is imported: a wrong path fails at once
    from fp4lightning.train.checkpoint import load_checkpoint
    from fp4lightning.models.hf import LM_EVAL_HINT, save_hf

    check_writable_dir(args.out_dir, "OUT_DIR")  # before loading: a bad path fails first
    if args.format == "nvfp4":
        return _export_hf_nvfp4(args)
    model, tokenizer, _ = load_checkpoint(args.ckpt)
    out = save_hf(model, args.out_dir, tokenizer, overwrite=args.overwrite)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    if tokenizer is not None:
        print(LM_EVAL_HINT.format(out=out))
    return 0


def _export_hf_nvfp4(args: argparse.Namespace) -> int:
    from fp4lightning.models.ct_export import save_hf_nvfp4
    from fp4lightning.train.checkpoint import load_checkpoint

    model, tokenizer, _ = load_checkpoint(args.ckpt, fp4=True)  # the FP4 layers as the run trained them
    report = save_hf_nvfp4(model, args.out_dir, tokenizer, args.requantize, args.overwrite)
    print("\n".join(report.lines()))
    print(f"wrote {report.path} (compressed-tensors NVFP4; load with transformers.AutoModelForCausalLM"
          f".from_pretrained({str(report.path)!r}), which decompresses it to bf16, or serve it with vLLM)")
    return 0


def _export_gguf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT", help="a .ckpt file or a run folder (runs/<name>)")
    parser.add_argument("out", metavar="OUT", help="the .gguf file to write (written beside it, renamed into place)")
    parser.add_argument("--dtype", choices=("f32", "f16"), default="f32",
                        help="GGUF type of the embeddings, the head and the layers trained in high precision "
                             "(norms stay f32) (default: f32)")
    parser.add_argument("--requantize", action="store_true",
                        help="a run whose FP4 weights no GGUF type holds exactly (the paper preset's float scales): "
                             "re-quantize them to MXFP4 and print each layer's weight SQNR")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _export_gguf_run(args: argparse.Namespace) -> int:
    from fp4lightning.models.export_file import check_export_file
    from fp4lightning.train.preflight import check_checkpoint_path

    check_export_file(args.out, args.overwrite)  # before torch is imported: a bad OUT fails at once
    check_checkpoint_path(args.ckpt, "CKPT")
    from fp4lightning.models.gguf_export import export_gguf
    from fp4lightning.train.checkpoint import load_checkpoint

    model, tokenizer, recipe = load_checkpoint(args.ckpt, fp4=True)
    report = export_gguf(model, tokenizer, args.out, args.dtype, args.requantize, args.overwrite,
                         name=recipe.name if recipe is not None else None)
    if report.sqnr_db:
        print(report.sqnr_line())
    print(f"wrote {report.path} ({report.summary()})")
    return 0


def _import_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face LlamaForCausalLM folder (config.json, weights)")
    parser.add_argument("out", metavar="OUT", nargs="?", default=None,
                        help="checkpoint to write (default: HF_DIR/fp4lightning.ckpt)")


def _import_hf_run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from fp4lightning.console import program
    from fp4lightning.train.init_weights import import_hf
    from fp4lightning.models.llama import LlamaConfig

    out = Path(args.out) if args.out else Path(args.hf_dir) / "fp4lightning.ckpt"
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder; name the checkpoint file to write (e.g. {out / 'model.ckpt'})")
    check_writable_dir(out.parent, "the folder of OUT")
    path, cfg, with_tok = import_hf(args.hf_dir, out)
    keys = " ".join(f"model.{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(LlamaConfig)
                    if f.name not in ("init_std", "max_seq_len"))
    print(f"wrote {path}\ntrain from it with:\n  {program()} train RECIPE init.from_checkpoint={path} {keys}")
    if with_tok:
        print("tokenizer: included (its data must be prepared with this tokenizer: the same data.dir it was "
              "trained on)")
    else:
        print("tokenizer: not included (the folder has none in fp4lightning's format); the data in data.dir must "
              "be tokenized with the model's own tokenizer")
    print(json.dumps({"checkpoint": str(path), "model": dataclasses.asdict(cfg)}))
    return 0


# ----------------------------------------------------------------------------- eval
def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint (.ckpt) to evaluate")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="evaluate two checkpoints (or read two results.json) and print them side by side, "
                             "e.g. --compare runs/fp4/last.ckpt runs/bf16/last.ckpt")
    parser.add_argument("--tasks", default="offline",
                        help="offline (held-out text, no network), paper (the paper's zero-shot tasks), "
                             "paper-ppl (its perplexity tasks) or comma-separated lm-eval task names "
                             "(default: offline)")
    parser.add_argument("--limit", type=float, default=None,
                        help="at most this many documents per task (a fraction < 1 means that share)")
    parser.add_argument("--batch-size", "--batch_size", type=_batch_size_arg, default=8,
                        help="requests per forward pass, or auto: the largest that fits (default: 8)")
    parser.add_argument("--include_path", "--include-path", action="append", default=None, metavar="DIR",
                        help="folder of your own lm-eval task YAMLs, as in lm-eval (repeatable); "
                             "their task names then work in --tasks")
    parser.add_argument("--linear", choices=("auto", "fp4", "high"), default="auto",
                        help="auto: as trained; fp4: FP4 GeMMs (converting a high-precision model with the paper "
                             "recipe); high: plain nn.Linear on the same weights (default: auto)")
    parser.add_argument("--fp4-preset", default=None,
                        help="FP4 recipe for --linear fp4 on a model trained in high precision (default: paper)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="autocast dtype around the forward pass (default: float32)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--data-dir", default=None,
                        help="prepared data directory whose held-out split the offline tasks come from "
                             "(default: data.dir of the run's recipe, else data/builtin)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json to use instead of the checkpoint's")
    parser.add_argument("--out", default=None,
                        help="output folder for results.json / results.md (default: <checkpoint dir>/eval/<stem>-<linear>; "
                             "with --compare, DIR/a, DIR/b and DIR/compare.md)")
    parser.add_argument("--bootstrap-iters", type=int, default=0,
                        help="lm-eval bootstrap iterations for standard errors (default: 0, none)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (OCC sampling, lm-eval) (default: 1234)")


def _batch_size_arg(value: str) -> int | str:
    if value.strip().startswith("auto"):
        return value.strip()
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _eval_run(args: argparse.Namespace) -> int:
    from fp4lightning.eval.run import run

    return run(args)


# ----------------------------------------------------------------------------- compare
DEFAULT_VARIANTS = "bf16,fp4,w4a4-direct,fp4-no-dge,fp4-no-occ"


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    _add_recipe_arguments(parser, "recipe overrides shared by every variant")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated: bf16, fp32, fp4, FP4 presets or fp4-dge-frozen, each optionally "
                             f"NAME@lr=X for its own peak learning rate (default: {DEFAULT_VARIANTS})")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train every variant with seeds seed..seed+N-1 (the recipe's seed first); "
                             "tables report mean, std and per-seed values (default: 1)")
    parser.add_argument("--reference", default=None,
                        help="variant the gaps are relative to (default: the BF16 variant with the lowest mean "
                             "validation loss, else the first)")
    parser.add_argument("--dge-probe", type=int, default=0, metavar="N",
                        help="record the weights' quantization error and in-interval positions every N steps "
                             "(fp4lightning.experiments.dge_probe); 0 = off")
    parser.add_argument("--out", default=None, help="output folder (default: runs/compare-<recipe name>)")
    parser.add_argument("--eval-tasks", default="offline",
                        help="lm-eval tasks for the zero-shot table (offline | paper | ...); 'none' skips it")
    parser.add_argument("--eval-limit", type=int, default=None, help="at most this many items per eval task")
    parser.add_argument("--no-occ-report", action="store_true", help="skip the OCC fidelity table")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs already in the output folder: a finished run whose recorded recipe "
                             "(its config.yaml) is this compare's, apart from names, folders, the corpus path and "
                             "thread counts, is reused; a cut-off one, or one whose only difference is a larger "
                             "schedule.max_steps, is resumed from its last.ckpt (to the new length); any other "
                             "difference starts it over. One line per run says which and why")
    _mixed_numerics_argument(parser)


def _mixed_numerics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-mixed-numerics", action="store_true",
                        help="pair runs whose numerics fingerprints differ (another machine kind, another code's "
                             "numerics) or that recorded none; the table says which pairs are mixed")


def _compare_run(args: argparse.Namespace) -> int:
    from fp4lightning.experiments.compare import compare, parse_variant
    from fp4lightning.train.preflight import check_recipe_inputs
    from fp4lightning.train.recipe import load_recipe

    recipe, overrides = _recipe_and_overrides(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]  # compare() checks the set
    for v in variants:  # a mistyped variant first: it is what the user just wrote
        parse_variant(v)
    check_recipe_inputs(load_recipe(recipe, overrides))  # before torch and Lightning
    compare(recipe, overrides, variants, Path(args.out) if args.out else None,
            None if args.eval_tasks == "none" else args.eval_tasks, args.eval_limit,
            not args.no_occ_report, args.reuse, seeds=args.seeds, dge_probe=args.dge_probe,
            reference=args.reference, allow_mixed_numerics=args.allow_mixed_numerics)
    return 0


def _compare_join_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("summaries", nargs="+", help="summary.json files written by `fp4lightning compare`")
    parser.add_argument("--out", required=True, help="where to write the joined summary.json")
    parser.add_argument("--reference", default=None,
                        help="variant the paired gaps are relative to (default: the BF16 variant with the lowest "
                             "mean validation loss)")
    _mixed_numerics_argument(parser)


def _compare_join_run(args: argparse.Namespace) -> int:
    import json

    from fp4lightning.experiments.compare import join_summaries

    joined, table = join_summaries([Path(p) for p in args.summaries], args.reference, args.allow_mixed_numerics)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(joined, indent=2))
    print(table)
    print(f"\n[compare-join] wrote {out}")
    return 0


# ----------------------------------------------------------------------------- occ-fidelity / format-fidelity
def _fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a training checkpoint (.ckpt)")
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="prepared data folder whose validation windows are scored (fp4lightning data prepare --out)")
    parser.add_argument("--seq-len", type=int, default=256, help="window length (the recipe's data.seq_len)")


def _occ_fidelity_arguments(parser: argparse.ArgumentParser) -> None:
    _fidelity_arguments(parser)
    parser.add_argument("--e4m3-fold", action="store_true",
                        help="compare exact compensation with the residual folded into an E4M3 operand")


def _check_fidelity_inputs(args: argparse.Namespace) -> None:
    """CKPT and --data exist, checked before torch is imported."""
    from fp4lightning.data.manifest import require_prepared
    from fp4lightning.train.preflight import check_checkpoint_path

    check_checkpoint_path(args.checkpoint, "CKPT")
    require_prepared(args.data)


def _occ_fidelity_run(args: argparse.Namespace) -> int:
    _check_fidelity_inputs(args)
    from fp4lightning.experiments.occ_fidelity import (E4M3_FOLD_VARIANTS, VARIANTS, checkpoint_occ_report,
                                                       format_occ_table)

    variants = VARIANTS + E4M3_FOLD_VARIANTS if args.e4m3_fold else VARIANTS
    print(format_occ_table(checkpoint_occ_report(Path(args.checkpoint), Path(args.data), args.seq_len,
                                                 variants=variants)))
    return 0


def _format_fidelity_run(args: argparse.Namespace) -> int:
    _check_fidelity_inputs(args)
    from fp4lightning.experiments.format_fidelity import checkpoint_format_report, format_fidelity_table

    print(format_fidelity_table(*checkpoint_format_report(Path(args.checkpoint), Path(args.data), args.seq_len,
                                                          gradients=True)))
    return 0


# ----------------------------------------------------------------------------- the command table
@dataclass(frozen=True)
class Command:
    """One subcommand: ``fp4lightning NAME``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: the subcommands, in --help order
COMMANDS: list[Command] = [
    Command("data", "prepare a corpus: tokenizer + token shards (`data prepare`)", _data_arguments, _data_run),
    Command("train", "pretrain a LLaMA from a recipe YAML", _train_arguments, _train_run),
    Command("export-hf", "write a training checkpoint as a Hugging Face LlamaForCausalLM folder",
            _export_hf_arguments, _export_hf_run),
    Command("export-gguf", "write a training checkpoint as a llama.cpp GGUF file, its FP4 layers as the MXFP4 / "
            "NVFP4 tensors training used", _export_gguf_arguments, _export_gguf_run),
    Command("import-hf", "turn a Hugging Face LlamaForCausalLM folder into a checkpoint to train from "
            "(init.from_checkpoint)", _import_hf_arguments, _import_hf_run),
    Command("eval", "zero-shot accuracy / perplexity of a checkpoint with lm-eval (offline tasks, the paper's "
            "tasks, FP4 vs BF16)", _eval_arguments, _eval_run),
    Command("compare", "train one recipe under several precisions (BF16, FP4, ablations) and seeds, and compare "
            "them", _compare_arguments, _compare_run),
    Command("compare-join", "join the summary.json files of `compare` runs of one recipe (seeds run apart) into one, "
            "with paired gaps", _compare_join_arguments, _compare_join_run),
    Command("occ-fidelity", "OCC fidelity (the paper's Table 1) on a checkpoint's real activations",
            _occ_fidelity_arguments, _occ_fidelity_run),
    Command("format-fidelity", "SQNR of every FP4 format on a checkpoint's activations, weights and gradients",
            _fidelity_arguments, _format_fidelity_run),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4lightning",
        description="FP4 (E2M1) pretraining of LLaMA models with PyTorch Lightning (arXiv 2501.17116).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp4lightning`` console script."""
    args = build_parser().parse_args(argv)
    return run_command(f"fp4lightning {args.command}", args._run, args)


if __name__ == "__main__":
    sys.exit(main())
