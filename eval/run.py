"""``fp4lightning eval``: zero-shot accuracy and perplexity of a checkpoint, and FP4 vs BF16 tables.

The paper's evaluation (arXiv 2501.17116, section 7) is lm-eval zero-shot accuracy on
PiQA, HellaSwag, OpenBookQA, ARC-Challenge, ARC-Easy, BoolQ, LogiQA, SciQ and
LAMBADA-OpenAI, and perplexity on LAMBADA-OpenAI, LAMBADA-standard, Pile-10k and WikiText,
each reported for an FP4 and a BF16 model side by side with the average. This command
runs those task groups (``paper``, ``paper-ppl``: they need the Hugging Face hub or a
filled HF cache), the offline tasks built from held-out text (``offline``, see
:mod:`fp4lightning.eval.tasks`), or any lm-eval task names, through the ``fp4lightning``
lm-eval model (:mod:`fp4lightning.eval.lm`), so FP4 checkpoints are scored with FP4 GeMMs.

    fp4lightning eval CKPT [--tasks offline|paper|paper-ppl|name,...] [--limit N]
                           [--batch-size B|auto] [--include_path DIR] [--linear auto|fp4|high] [--out DIR]
    fp4lightning eval --compare CKPT_OR_RESULTS_A CKPT_OR_RESULTS_B [same options]

Each evaluation writes ``results.json`` (lm-eval's results plus ours under
``"fp4lightning"``) and ``results.md`` (a markdown table) into ``--out``; ``--compare``
also writes ``compare.md`` / ``compare.json``. ``--compare`` takes checkpoints or
``results.json`` files from earlier runs.

lm_eval, the model and torch are imported inside functions: the Hugging Face offline switches
must be in the environment before ``datasets`` / ``huggingface_hub`` are first imported, and
``fp4lightning compare-join``, which imports this module, stays light.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from fp4lightning.console import program
from fp4lightning.errors import InputNotFoundError, UsageError, UserError, check_writable_dir
from fp4lightning.eval.tasks import OFFLINE_TASKS, build_offline_tasks, offline_tasks_ready

__all__ = [
    "PAPER_TASKS",
    "PAPER_PPL_TASKS",
    "TASK_GROUPS",
    "HubUnavailableError",
    "run",
    "evaluate_checkpoint",
    "resolve_tasks",
    "headline_metrics",
    "metric_kind",
    "results_table",
    "compare_table",
    "AVERAGED_GROUPS",
    "prepare_hf_environment",
]

#: the paper's zero-shot accuracy tasks (section 7), lm-eval names
PAPER_TASKS = ("piqa", "hellaswag", "openbookqa", "arc_challenge", "arc_easy", "boolq", "logiqa", "sciq",
               "lambada_openai")
#: the paper's perplexity tasks; lm-eval 0.4.x has Pile-10k as ``pile_10k``
PAPER_PPL_TASKS = ("lambada_openai", "lambada_standard", "wikitext", "pile_10k")

# task -> [(metric, kind)] reported in tables and averages; kind "acc" (higher is better,
# shown in %) or "ppl" (lower is better). The paper averages accuracy over its zero-shot
# tasks and perplexity over its perplexity tasks.
_HEADLINE: dict[str, list[tuple[str, str]]] = {
    **{t: [("acc", "acc")] for t in PAPER_TASKS},
    "lambada_openai": [("acc", "acc"), ("perplexity", "ppl")],
    "lambada_standard": [("acc", "acc"), ("perplexity", "ppl")],
    "wikitext": [("word_perplexity", "ppl"), ("bits_per_byte", "bpb")],
    "pile_10k": [("word_perplexity", "ppl"), ("bits_per_byte", "bpb")],
    "fp4l_lastword": [("acc", "acc"), ("perplexity", "ppl")],
    "fp4l_cloze": [("acc", "acc"), ("acc_norm", "acc_norm")],
    "fp4l_ppl": [("word_perplexity", "ppl"), ("bits_per_byte", "bpb")],
}


# folders of lm_eval/tasks holding the paper's tasks: indexing just these takes well under a
# second, the whole ~14k-YAML tree several seconds
_BUILTIN_TASK_DIRS = {
    "piqa": "piqa", "hellaswag": "hellaswag", "openbookqa": "openbookqa", "arc_challenge": "arc",
    "arc_easy": "arc", "boolq": "super_glue/boolq", "logiqa": "logiqa", "sciq": "sciq",
    "lambada_openai": "lambada", "lambada_standard": "lambada", "wikitext": "wikitext", "pile_10k": "pile_10k",
}


TASK_GROUPS = {"paper": PAPER_TASKS, "paper-ppl": PAPER_PPL_TASKS}  # and "offline": OFFLINE_TASKS


class HubUnavailableError(UserError, RuntimeError):
    """A hub-hosted lm-eval task cannot be loaded (no network and no cached copy)."""


# ----------------------------------------------------------------------------- tasks
def resolve_tasks(spec: str | list[str]) -> list[str]:
    """Task names from ``offline`` / ``paper`` / ``paper-ppl`` / comma-separated names (order kept, no repeats)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        if item in ("offline", "fp4l_offline"):
            names = OFFLINE_TASKS
        elif item in TASK_GROUPS:
            names = TASK_GROUPS[item]
        else:
            names = (item,)
        out.extend(n for n in names if n not in out)
    if not out:
        raise UsageError("--tasks is empty; use offline, paper, paper-ppl or comma-separated lm-eval task names")
    return out


def _hub_host() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def prepare_hf_environment(need_hub: bool, probe_timeout: float = 3.0) -> bool:
    """Set the Hugging Face offline switches before lm_eval is imported; returns "hub reachable".

    Without hub tasks, or when the hub does not answer within ``probe_timeout`` seconds,
    ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` are set so that nothing waits on network
    retries (~30 s per task otherwise) and datasets already in the HF cache still load.
    """
    if _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE"):
        reachable = False
    elif not need_hub:
        reachable = False
    else:
        try:
            with socket.create_connection(_hub_host(), timeout=probe_timeout):
                reachable = True
        except OSError:
            reachable = False
    if not reachable:
        if need_hub and ("datasets" in sys.modules or "huggingface_hub" in sys.modules):
            if not (_truthy("HF_HUB_OFFLINE") and _truthy("HF_DATASETS_OFFLINE")):
                print("[eval] warning: the Hugging Face libraries were imported before the offline switches "
                      "could be set; hub tasks may retry for a while", file=sys.stderr)
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    return reachable


def _offline_task_dir_exists(data_dir: Path) -> None:
    if not (data_dir / "meta.json").is_file():
        raise InputNotFoundError(
            f"the offline tasks are built from a prepared data directory, and {data_dir} is not one "
            f"(no meta.json). Prepare it ({program()} data prepare --out {data_dir}) or pass --data-dir"
        )


def _offline_task_dir(data_dir: Path) -> Path:
    _offline_task_dir_exists(data_dir)
    if not offline_tasks_ready(data_dir):
        print(f"[eval] building the offline tasks from the held-out split of {data_dir}", file=sys.stderr)
    return build_offline_tasks(data_dir)


# the TaskManager that loaded the tasks goes on to simple_evaluate, which would otherwise
# build one indexing all ~14k built-in YAMLs (seconds) only to pass our Task objects through
_TASK_MANAGERS: list = []


def _user_tasks(include_path: list[str] | None) -> set[str]:
    """Task (and group) names defined by the YAMLs under the user's ``--include_path`` folders."""
    if not include_path:
        return set()
    for p in include_path:
        if not Path(p).is_dir():
            raise InputNotFoundError(f"--include_path {p} is not a folder (it should hold lm-eval task YAMLs)")
    from lm_eval.tasks import TaskManager

    return set(TaskManager(include_path=list(include_path), include_defaults=False).all_tasks)


def _load_tasks(names: list[str], data_dir: Path | None, hub_reachable: bool,
                include_path: list[str] | None = None) -> dict:
    """``{name: lm-eval Task}``; hub tasks that cannot load fail together, with advice."""
    offline = set(OFFLINE_TASKS)
    user = _user_tasks(include_path)
    include = None
    if any(n in offline for n in names):
        if data_dir is None:
            raise UsageError("offline tasks need a prepared data directory: pass --data-dir")
        include = str(_offline_task_dir(data_dir))
    others = [n for n in names if n not in offline and n not in user]
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    paths = ([include] if include else []) + [str(Path(p).resolve()) for p in include_path or []]
    builtin_root = Path(lm_eval.tasks.__file__).parent
    known = [builtin_root / _BUILTIN_TASK_DIRS[n] for n in others if n in _BUILTIN_TASK_DIRS]
    if len(known) == len(others) and all(p.is_dir() for p in known):
        paths += sorted({str(p) for p in known})
        full_index = False
    else:
        full_index = bool(others)
    tm = TaskManager(include_path=paths or None, include_defaults=full_index)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise UsageError(
            f"unknown lm-eval task(s) {unknown}; use offline, paper, paper-ppl, names from `lm-eval ls tasks`, "
            "or tasks defined in the YAMLs of an --include_path folder"
        )
    tasks, failed = {}, []
    for name in names:
        try:
            loaded = tm.load([name])
        except Exception as e:  # datasets raises ConnectionError / FileNotFoundError / hub errors
            if name in offline or name in user:
                raise
            failed.append((name, e))
            continue
        tasks[name] = loaded["tasks"][name]
    _TASK_MANAGERS.append(tm)
    if failed:
        why = "\n".join(f"  {n}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" for n, e in failed)
        where = ("the hub answered but the dataset could not be loaded" if hub_reachable
                 else "the Hugging Face hub is unreachable (offline) and the dataset is not in the HF cache")
        raise HubUnavailableError(
            f"could not load {len(failed)} lm-eval task(s) from the Hugging Face hub: {where}.\n{why}\n"
            "These tasks need network access to huggingface.co (or a populated HF_DATASETS_CACHE). "
            "Offline, evaluate on the tasks built from held-out text instead: --tasks offline"
        )
    return tasks


# ----------------------------------------------------------------------------- results
def headline_metrics(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of the metrics tables show (filter ``none``), from lm-eval results."""
    out: dict[str, dict[str, float]] = {}
    for task, res in results.get("results", {}).items():
        wanted = _HEADLINE.get(task)
        found = {}
        for key, value in res.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            if filt == "none":
                found[metric] = float(value)
        order = [m for m, _ in wanted] if wanted else list(found)
        metrics = {m: found[m] for m in order if m in found}
        if metrics:
            out[task] = metrics
    return out


def metric_kind(task: str, metric: str) -> str:
    """How a table shows ``metric`` of ``task``: ``"acc"`` / ``"acc_norm"`` (an accuracy, in percent),
    ``"ppl"`` (a perplexity), ``"bpb"`` (bits per byte) or ``"other"`` (as lm-eval reports it)."""
    for m, k in _HEADLINE.get(task, []):
        if m == metric:
            return k
    if metric.startswith("acc") or metric in ("exact_match", "mcc", "f1"):
        return "acc"
    if "perplexity" in metric:
        return "ppl"
    return "other"


def _fmt(value: float | None, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind in ("acc", "acc_norm"):
        return f"{100 * value:.2f}"
    if kind == "bpb":
        return f"{value:.4f}"
    return f"{value:.2f}" if value < 1e6 else f"{value:.3g}"


#: The task groups whose scores the paper averages, one average per metric over the group's tasks
#: that report it: accuracy (``acc``) over its zero-shot tasks, each perplexity metric over its
#: perplexity tasks (LAMBADA's ``perplexity`` per target word and WikiText's or Pile-10k's
#: ``word_perplexity`` are different units, so each has its own average). Any other tasks (the
#: offline ones, a user's own) measure unrelated things: no average mixes them, and a metric only
#: one task of a group reports gets no average row either.
AVERAGED_GROUPS = (("paper", PAPER_TASKS, "acc"), ("paper-ppl", PAPER_PPL_TASKS, "ppl"))


def _averaged(task: str, metric: str, kind: str) -> bool:
    return metric == "acc" if kind == "acc" else metric_kind(task, metric) == "ppl"


def _averages(metrics: dict[str, dict[str, float]]) -> dict[tuple[str, str], tuple[int, float]]:
    """``{(group, metric): (tasks, mean)}``: the paper's averages (:data:`AVERAGED_GROUPS`) over the
    tasks of ``metrics`` in each group, for every metric at least two of them report."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for group, tasks, kind in AVERAGED_GROUPS:
        values: dict[str, list[float]] = {}
        for task in (t for t in tasks if t in metrics):
            for metric, value in metrics[task].items():
                if _averaged(task, metric, kind):
                    values.setdefault(metric, []).append(value)
        out.update({(group, m): (len(vs), sum(vs) / len(vs)) for m, vs in values.items() if len(vs) > 1})
    return out


def _average_label(group: str, n: int) -> str:
    return f"**Average** ({group}, {n} tasks)"


def _average_kind(metric: str) -> str:
    return "acc" if metric == "acc" else "ppl"


def results_table(metrics: dict[str, dict[str, float]]) -> str:
    """Markdown table of one evaluation (accuracy in %, perplexity, bits per byte), with the paper's
    averages where its task groups are evaluated (:data:`AVERAGED_GROUPS`)."""
    lines = ["| Task | Metric | Value |", "|---|---|---:|"]
    for task, ms in metrics.items():
        for metric, value in ms.items():
            lines.append(f"| {task} | {metric} | {_fmt(value, metric_kind(task, metric))} |")
    for (group, metric), (n, value) in _averages(metrics).items():
        lines.append(f"| {_average_label(group, n)} | {metric} | {_fmt(value, _average_kind(metric))} |")
    return "\n".join(lines)


def compare_table(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]],
                  label_a: str = "A", label_b: str = "B") -> str:
    """Side-by-side markdown table (per task and metric, plus the paper's averages over the tasks both have)."""
    tasks = [t for t in a if t in b] + [t for t in a if t not in b] + [t for t in b if t not in a]
    lines = [f"| Task | Metric | {label_a} | {label_b} | {label_a} - {label_b} |", "|---|---|---:|---:|---:|"]
    for task in tasks:
        ma, mb = a.get(task, {}), b.get(task, {})
        for metric in list(ma) + [m for m in mb if m not in ma]:
            kind = metric_kind(task, metric)
            va, vb = ma.get(metric), mb.get(metric)
            delta = "-" if va is None or vb is None else _fmt_delta(va - vb, kind)
            lines.append(f"| {task} | {metric} | {_fmt(va, kind)} | {_fmt(vb, kind)} | {delta} |")
    common = [t for t in a if t in b]
    avg_a = _averages({t: a[t] for t in common})
    avg_b = _averages({t: b[t] for t in common})
    for key in [k for k in avg_a if k in avg_b and avg_a[k][0] == avg_b[k][0]]:
        (group, metric), kind = key, _average_kind(key[1])
        (n, va), (_, vb) = avg_a[key], avg_b[key]
        lines.append(f"| {_average_label(group, n)} | {metric} | {_fmt(va, kind)} | {_fmt(vb, kind)} | "
                     f"{_fmt_delta(va - vb, kind)} |")
    return "\n".join(lines)


def _fmt_delta(d: float, kind: str) -> str:
    if kind in ("acc", "acc_norm"):
        return f"{100 * d:+.2f}"
    if kind == "bpb":
        return f"{d:+.4f}"
    return f"{d:+.2f}" if abs(d) < 1e6 else f"{d:+.3g}"


def _json_default(o):
    try:
        from lm_eval.utils import handle_non_serializable

        return handle_non_serializable(o)
    except Exception:
        return str(o)


# ----------------------------------------------------------------------------- evaluation
def _default_data_dir(recipe) -> Path:
    """The data directory the run trained on (``data.dir`` of its recipe), else ``data/builtin``."""
    data = getattr(recipe, "data", None)
    return Path(getattr(data, "dir", None) or "data/builtin")


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: str | list[str] = "offline",
    *,
    limit: int | float | None = None,
    batch_size: int | str = 8,
    linear: str = "auto",
    fp4_preset: str | None = None,
    dtype: str = "float32",
    device: str | None = None,
    data_dir: str | Path | None = None,
    tokenizer: str | Path | None = None,
    out_dir: str | Path | None = None,
    bootstrap_iters: int = 0,
    seed: int = 1234,
    verbose: bool = True,
    include_path: list[str] | str | None = None,
) -> dict:
    """Evaluate one checkpoint; returns lm-eval's results dict plus ``"fp4lightning"`` (ours).

    Hub tasks are loaded first, so an unreachable hub fails (:class:`HubUnavailableError`)
    before the model is read. The offline tasks come from ``data_dir`` (default: the
    run's ``data.dir``), built there on first use. ``out_dir`` (if given) receives
    ``results.json`` and ``results.md``. ``include_path`` (a folder or a list) holds the
    user's own lm-eval task YAMLs, as lm-eval's ``--include_path``; ``batch_size`` may be
    ``"auto"`` (see :meth:`fp4lightning.eval.lm.FP4LightningLM.detect_batch_size`).
    """
    names = resolve_tasks(tasks)
    if isinstance(include_path, (str, Path)):
        include_path = [str(include_path)]
    offline = set(OFFLINE_TASKS)
    user = _user_tasks(include_path) if include_path else set()
    reachable = prepare_hf_environment(any(n not in offline and n not in user for n in names))
    t0 = time.perf_counter()
    _TASK_MANAGERS.clear()
    first = [n for n in names if n not in offline]  # hub and user tasks load before the model
    task_objs = _load_tasks(first, None, reachable, include_path) if first else {}

    from fp4lightning.eval.lm import FP4LightningLM

    lm = FP4LightningLM(pretrained=str(checkpoint), tokenizer=tokenizer, linear=linear, fp4_preset=fp4_preset,
                        dtype=dtype, batch_size=batch_size, device=device)
    offline_names = [n for n in names if n in offline]
    data_dir = Path(data_dir) if data_dir is not None else _default_data_dir(lm.recipe)
    if offline_names:
        task_objs.update(_load_tasks(offline_names, data_dir.resolve(), reachable))
    results = _run_lm_eval(lm, [task_objs[n] for n in names], limit, bootstrap_iters, seed)
    results["fp4lightning"] = {
        "checkpoint": str(Path(lm.checkpoint).resolve()),
        "linear": lm.linear,
        "trained_fp4": lm.trained_fp4,
        "fp4_config": lm.fp4_config,
        "dtype": dtype,
        "tasks": names,
        "limit": limit,
        "batch_size": lm.batch_size,
        "include_path": include_path,
        "data_dir": str(data_dir.resolve()) if offline_names else None,
        "seconds": round(time.perf_counter() - t0, 2),
        "metrics": headline_metrics(results),
    }
    _write_results(results, out_dir, verbose)
    return results


def _run_lm_eval(lm, task_objs: list, limit: int | float | None, bootstrap_iters: int, seed: int) -> dict:
    """``lm_eval.simple_evaluate`` of the loaded tasks on ``lm``, every random seed set to ``seed``."""
    import lm_eval

    from fp4lightning.eval.lm import quiet_git_hash

    if not sys.stderr.isatty():  # a log: lm-eval calls the request loops without their switch for the bars
        for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, name, functools.partial(getattr(lm, name), disable_tqdm=True))
    with quiet_git_hash():
        return lm_eval.simple_evaluate(
            model=lm, tasks=task_objs, task_manager=_TASK_MANAGERS.pop(),
            limit=limit, bootstrap_iters=bootstrap_iters,
            log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed,
        )


def _write_results(results: dict, out_dir: str | Path | None, verbose: bool) -> None:
    """``results.json`` and ``results.md`` into ``out_dir`` (if given); the table on stdout if ``verbose``."""
    table = results_table(results["fp4lightning"]["metrics"])
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        results.pop("samples", None)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default))
        (out / "results.md").write_text(f"{_label(results)}\n\n{table}\n")
    if verbose:
        print(f"\n{_label(results)}\n\n{table}\n")


def _label(results: dict) -> str:
    info = results.get("fp4lightning", {})
    return f"{info.get('checkpoint', '?')} [linear={info.get('linear', '?')}]"


def _load_or_evaluate(item: str, args: argparse.Namespace, out_dir: Path | None) -> dict:
    path = Path(item)
    if path.suffix == ".json":
        if not path.is_file():
            raise InputNotFoundError(f"results file {path} not found")
        results = json.loads(path.read_text())
        if "fp4lightning" not in results:
            results["fp4lightning"] = {"checkpoint": str(path), "linear": "?", "metrics": headline_metrics(results)}
        return results
    return evaluate_checkpoint(
        path, args.tasks, limit=args.limit, batch_size=args.batch_size, linear=args.linear,
        fp4_preset=args.fp4_preset, dtype=args.dtype,
        device=args.device, data_dir=args.data_dir, tokenizer=args.tokenizer, out_dir=out_dir,
        bootstrap_iters=args.bootstrap_iters, seed=args.seed, include_path=args.include_path,
    )


# ----------------------------------------------------------------------------- the eval command
def _limit(value: float | None) -> int | float | None:
    if value is None:
        return None
    if value <= 0:
        raise UsageError(f"--limit must be positive, got {value}")
    return int(value) if value >= 1 else value


def _default_out(ckpt: Path, linear: str) -> Path:
    return ckpt.resolve().parent / "eval" / f"{ckpt.stem}-{linear}"


def _check_inputs(args: argparse.Namespace) -> None:
    """The files the arguments name exist, checked before torch and lm-eval are imported (10-20 s)."""
    from fp4lightning.train.preflight import check_checkpoint_path

    for item in args.compare or ([args.checkpoint] if args.checkpoint else []):
        if Path(item).suffix == ".json":
            if not Path(item).is_file():
                raise InputNotFoundError(f"results file {item} not found (a results.json written by "
                                         "`fp4lightning eval`; or pass a checkpoint)")
        else:
            check_checkpoint_path(item, "checkpoint")
    if args.tokenizer is not None:
        tok = Path(args.tokenizer)
        if not (tok / "tokenizer.json" if tok.is_dir() else tok).is_file():
            raise InputNotFoundError(f"--tokenizer {tok}: no tokenizer.json there; pass the tokenizer.json of the "
                                     "data the model was trained on (<data_dir>/tokenizer.json) or its folder")
    if args.data_dir is not None and set(resolve_tasks(args.tasks)) & set(OFFLINE_TASKS):
        _offline_task_dir_exists(Path(args.data_dir))


def run(args: argparse.Namespace) -> int:
    """Run ``fp4lightning eval`` from parsed arguments; returns the exit code."""
    if not sys.stderr.isatty():
        # a log, not a terminal: no progress bars (lm-eval's, datasets'); tqdm and datasets read these
        # when first imported, which is below
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    args.limit = _limit(args.limit)
    if args.out:  # before anything is read or loaded: a bad output path fails first
        check_writable_dir(args.out, "--out")
    _check_inputs(args)
    if args.compare:
        if args.checkpoint:
            raise UsageError("give either CKPT or --compare A B, not both")
        res = []
        for tag, item in zip(("a", "b"), args.compare):
            out = None
            if Path(item).suffix != ".json":
                out = (Path(args.out) / tag) if args.out else _default_out(Path(item), args.linear)
            res.append(_load_or_evaluate(item, args, out))
        ma, mb = (r["fp4lightning"].get("metrics") or headline_metrics(r) for r in res)
        la, lb = (_short_label(r) for r in res)
        if la == lb:
            la, lb = f"A: {la}", f"B: {lb}"
        table = compare_table(ma, mb, la, lb)
        legend = f"A = {_label(res[0])}\nB = {_label(res[1])}"
        print(f"\n{legend}\n\n{table}\n")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "compare.md").write_text(f"{legend}\n\n{table}\n")
            (out / "compare.json").write_text(json.dumps({"a": res[0]["fp4lightning"], "b": res[1]["fp4lightning"]},
                                                         indent=2, default=_json_default))
        return 0
    if not args.checkpoint:
        raise UsageError("give a checkpoint to evaluate (fp4lightning eval CKPT) or --compare A B")
    out = Path(args.out) if args.out else _default_out(Path(args.checkpoint), args.linear)
    _load_or_evaluate(args.checkpoint, args, out)
    print(f"[eval] wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


def _short_label(results: dict) -> str:
    """``FP4`` / ``BF16`` (how the run trained), noting an evaluation in the other mode."""
    info = results.get("fp4lightning", {})
    trained = info.get("trained_fp4")
    linear = info.get("linear", "?")
    if trained is None:
        return {"fp4": "FP4", "high": "BF16"}.get(linear, linear)
    name = "FP4" if trained else "BF16"
    if (linear == "fp4") != bool(trained):
        name += f" (eval {linear})"
    return name
