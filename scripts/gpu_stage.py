#!/usr/bin/env python3
"""The GPU check's stages (``bash scripts/gpu_check.sh STAGE``; docs/perf.md, "GPU check").

Each stage fits one call of the lent GPU machine (at most 600 s a call, about 15 minutes of GPU
time a task, start-up included): its steps run as child processes under their own time limits
(``STEP_LIMIT_S``) inside the stage's budget (``STAGE_BUDGET_S``, 2-4.7 minutes; the main stages,
in the two calls of ``CALLS``, 11.9 minutes), and what each step measures goes into
``docs/perf/h200.json`` under the stage's key as soon as it is measured (the profile and the layer
table layer by layer, the 1.3B step precision by precision, the training run's logged tokens/s as
it logs; also copied to ``$OUT/h200.json`` when ``$OUT`` is set). A stage cut short keeps what it
measured and every other stage's part.

    python scripts/gpu_stage.py stage profile|layers|checks|step|train|step-torchao|extras|kernels|kernel-bench
    python scripts/gpu_stage.py imports STAGE ...        # what a stage imports (and its recipe, data)
    python scripts/gpu_stage.py wheels --target DIR      # the carried .whl/*.whl, installed into DIR

Where the budgets come from: the first run of these stages on an H200 (docs/perf.md, "GPU check"),
each limit about 1.3-1.6x the time the step took there (the kernel checks 60 s with process start
and JIT, the scaled_mm tests 44 s, the layer table 54 s, the 1.3B step 22-34 s a precision, the
training command 82 s). GPU work is the small part (one layer's forward + backward at 8192 tokens is
1.5-4.7 ms); what fills a stage is compiling: Triton's JIT for every kernel (cached on the machine's
disk for the later stages of a call), torchao's and the decoder blocks' ``torch.compile``. The 1.3B
step with torchao float8 compiled did not finish in 140 s there, so it has a stage of its own
(``step-torchao``), outside the main ones.

Exit status: 0 all passed, 1 a wrong result, crash or import error, 2 a step ran out of time.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path(os.environ.get("GPU_CHECK_RECORD", ROOT / "docs" / "perf" / "h200.json"))
PY = sys.executable
RECIPE = "recipes/llama2-1.3b.yaml"
DATA = "data/builtin"
ROOFLINE_JSON = ROOT / ".whl" / "roofline.json"  # written by scripts/gpu_pack.sh
#: each stage ends within its budget (s); the main stages (``CALLS``) add up to 715 s, which with a lent
#: machine's start-up (about a minute) stays under 13 of the task's 15 minutes of GPU time
STAGE_BUDGET_S = {"profile": 150, "layers": 120, "checks": 190, "step": 125, "train": 130,
                  "step-torchao": 280, "extras": 230, "kernels": 230, "kernel-bench": 230, "memory": 230}
#: each step's time limit (s) inside its stage (cut to what is left of the stage's budget); a stage's
#: limits add up to at most its budget
STEP_LIMIT_S = {
    "profile": {"profile": 140},
    "layers": {"table": 110},  # the roofline, when .whl/roofline.json is missing, gets what is left
    "checks": {"probe": 30, "kernel_checks": 80, "scaled_mm_tests": 70},
    "step": {"bf16-mixed": 45, "fp4": 45, "w4a4-direct": 35},
    "train": {"train": 125},
    "step-torchao": {"torchao-float8": 270},
    "extras": {"step_1.3b_eager": 110, "weight_reuse": 60, "optimizer": 45},
    "kernels": {"gpu_tests": 110, "small_tests": 110},
    "kernel-bench": {"timings": 220},
    "memory": {"block_memory": 120, "block_memory_budget": 100},
}
#: the plan for a lent machine: one ``gpu_check.sh`` call per entry, in this order (each under 600 s):
#: first what guides the optimisation (where the layers' time goes, the layer table), then correctness,
#: the 1.3B step and the user's command
CALLS = (("profile", "layers"), ("checks", "step", "train"))
#: the stages ``gpu_check.sh all`` runs, in order
MAIN_STAGES = tuple(s for call in CALLS for s in call)
#: ``GPU_CHECK_BUDGET_S`` sets every stage's budget at once (lower it when less GPU time is left)
BUDGET_S = float(os.environ["GPU_CHECK_BUDGET_S"]) if os.environ.get("GPU_CHECK_BUDGET_S") else None
#: a step is not started with less time than this left in its stage
MIN_STEP_S = 25
#: how often a running step's output file is read back into the record
POLL_S = 2.0
#: the user's command, cut to a few steps on one GPU: the built-in corpus (4096-token BPE; the
#: 1.3B model keeps its 32000-row embedding and head, so a step costs what it costs on DCLM)
TRAIN_OVERRIDES = ["data.source=builtin", f"data.dir={DATA}", "trainer.devices=1", "trainer.strategy=auto",
                   "data.global_batch_size=8", "schedule.max_steps=12", "trainer.log_every_n_steps=2"]
#: the record's key of each stage
KEYS = {"profile": "profile", "layers": "layers", "checks": "checks", "step": "step_1.3b", "train": "train_1.3b",
        "step-torchao": "step_1.3b_torchao", "extras": "extras", "kernels": "kernel_tests",
        "kernel-bench": "kernel_bench", "memory": "block_memory"}
#: what each stage imports: modules, benchmark scripts (imported, not run), optional modules
#: (a row reads n/a without them), a recipe with overrides to resolve, a prepared data folder
COMMON = ["torch", "triton", "fp4lightning", "fp4lightning.ops.gemm", "fp4lightning.kernels.fp4_triton",
          "fp4lightning.kernels.scaled_mm"]
NEEDS = {
    "profile": dict(scripts=["benchmarks/profile_linear.py", "benchmarks/bench_linear.py", "benchmarks/roofline.py"],
                    optional=["torchao.float8"]),
    "checks": dict(modules=["pytest", "tests.test_scaled_mm", "tests.test_capability_probe"],
                   scripts=["benchmarks/bench_kernels.py"]),
    "layers": dict(scripts=["benchmarks/bench_linear.py"], optional=["torchao.float8"]),
    "step": dict(modules=["omegaconf", "fp4lightning.train.run"], scripts=["benchmarks/bench_train.py"], recipe=[]),
    "step-torchao": dict(modules=["omegaconf", "fp4lightning.train.run", "torchao.float8"],
                         scripts=["benchmarks/bench_train.py"], recipe=[]),
    "train": dict(modules=["omegaconf", "fp4lightning.cli", "fp4lightning.train.run"], recipe=TRAIN_OVERRIDES,
                  data=DATA),
    "extras": dict(modules=["omegaconf"], scripts=["benchmarks/bench_train.py", "benchmarks/bench_weight_reuse.py",
                                                   "benchmarks/bench_optim.py"], recipe=[]),
    "kernels": dict(modules=["pytest", "tests.test_kernels", "tests.test_block_kernels"]),
    "kernel-bench": dict(scripts=["benchmarks/bench_kernels.py"]),
    "memory": dict(scripts=["benchmarks/bench_block_memory.py"]),
}


def load_site() -> None:
    """This checkout's package, ``kernels/`` as ``fp4lightning.kernels`` (also under ``python -S``)."""
    spec = importlib.util.spec_from_file_location("fp4l_gpu_site", ROOT / "scripts" / "gpu_site" / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


# --------------------------------------------------------------------------- the record
def read_record() -> dict:
    try:
        return json.loads(RECORD.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def update(path: str, value) -> None:
    """Set ``path`` ('key/sub/...') of the record to ``value`` and write it (atomically; and to $OUT)."""
    rec = read_record()
    *parents, last = path.split("/")
    node = rec
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    tmp = RECORD.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    os.replace(tmp, RECORD)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "h200.json"
        out.write_text(RECORD.read_text())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- imports
def _import_script(rel: str) -> None:
    spec = importlib.util.spec_from_file_location(f"gpu_check_{Path(rel).stem}", ROOT / rel)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(mod)


def check_imports(stage: str) -> list[str]:
    """What is missing for ``stage`` here, one line each saying how to fix it (empty: nothing)."""
    need = NEEDS[stage]
    problems = []
    for what, load in ([(m, importlib.import_module) for m in COMMON + need.get("modules", [])]
                       + [(s, _import_script) for s in need.get("scripts", [])]):
        try:
            load(what)
        except Exception as e:  # noqa: BLE001 - every failure is reported, the first one is not enough
            hint = (" (not in the GPU image: run scripts/gpu_pack.sh here and carry .whl)"
                    if isinstance(e, ImportError) and "omegaconf" in str(e) else "")
            problems.append(f"{stage}: importing {what} failed: {type(e).__name__}: {e}{hint}")
    for mod in need.get("optional", []):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            print(f"({stage}: optional {mod} does not import, its rows read n/a: {type(e).__name__}: {e})")
    if "recipe" in need and not problems:
        try:
            from fp4lightning.train.recipe import load_recipe
            load_recipe(ROOT / RECIPE, need["recipe"])
        except Exception as e:  # noqa: BLE001
            problems.append(f"{stage}: {RECIPE} with {' '.join(need['recipe'])} does not resolve: {e}")
    if "data" in need and not (ROOT / need["data"] / "meta.json").is_file():
        problems.append(f"{stage}: {need['data']}/meta.json is missing: carry {need['data']} "
                        "(scripts/gpu_pack.sh prints the carry list)")
    return problems


def install_wheels(target: Path) -> int:
    """``pip install --no-index --no-deps --target`` of every carried wheel (skipped when the same
    wheels are there already: a warm machine keeps /tmp between calls)."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        print("(no .whl/*.whl: nothing carried to install; scripts/gpu_pack.sh builds them)")
        return 0
    stamp = hashlib.sha256("".join(f"{w.name}:{w.stat().st_size};" for w in wheels).encode()).hexdigest()
    if (target / ".gpu_check_wheels").is_file() and (target / ".gpu_check_wheels").read_text() == stamp:
        return 0
    rc = subprocess.call([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(target),
                          *map(str, wheels)])
    if rc == 0:
        (target / ".gpu_check_wheels").write_text(stamp)
        print(f"installed {', '.join(w.name.split('-')[0] + ' ' + w.name.split('-')[1] for w in wheels)} into {target}")
    return rc


# --------------------------------------------------------------------------- running a step
class Stage:
    """One stage's steps: each a child process under a time limit inside the stage's budget, its
    status and (through ``poll``) its figures written to the record as they come."""

    def __init__(self, name: str, budget_s: float | None = None):
        self.name, self.key = name, KEYS[name]
        self.t0 = time.time()
        self.budget_s = budget_s if budget_s is not None else BUDGET_S or STAGE_BUDGET_S[name]
        self.failed, self.incomplete = [], []
        self.tmp = Path(os.environ.get("GPU_CHECK_TMP", "/tmp/fp4lightning-gpu-check"))
        self.tmp.mkdir(parents=True, exist_ok=True)
        update(self.key, {"status": "running", "started": _now(), "commit": _commit(), "runs": {}})

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def run(self, name: str, cmd: list, limit: float | None = None, env: dict | None = None,
            poll=None) -> int | None:
        """Run ``cmd`` for at most ``limit`` s (default: the step's ``STEP_LIMIT_S``; less if the stage's
        budget ends first); ``poll()`` returns (record path, value) to write whenever the value changed,
        or None."""
        limit = min(STEP_LIMIT_S[self.name][name] if limit is None else limit, self.remaining() - 5)
        if limit < MIN_STEP_S:
            self._status(name, {"status": "skipped", "why": "the stage's time ran out"})
            self.incomplete.append(name)
            return None
        print(f"\n=== [{self.name} {time.time() - self.t0:.0f}s] {name} (limit {limit:.0f} s): "
              f"{' '.join(map(str, cmd))}", flush=True)
        t0 = time.time()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env={**os.environ, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        tail = collections.deque(maxlen=12)
        reader = threading.Thread(target=_relay, args=(proc.stdout, tail), daemon=True)
        reader.start()
        timed_out, last = False, None
        while proc.poll() is None:
            if time.time() - t0 > limit:
                timed_out = True
                _stop(proc)
                break
            last = _merge_poll(poll, last)
            time.sleep(POLL_S)
        rc = proc.wait()
        reader.join(timeout=5)
        _merge_poll(poll, last)
        status = "timed out" if timed_out else ("passed" if rc == 0 else "failed")
        (self.incomplete if timed_out else self.failed if rc else []).append(name)
        self._status(name, {"status": status, "rc": rc, "seconds": round(time.time() - t0, 1),
                            "limit_s": round(limit), **({"tail": list(tail)} if rc else {})})
        return rc

    def _status(self, name: str, value: dict) -> None:
        update(f"{self.key}/runs/{name}", value)

    def finish(self) -> int:
        status = "failed" if self.failed else "incomplete" if self.incomplete else "passed"
        update(f"{self.key}/status", status)
        update(f"{self.key}/seconds", round(time.time() - self.t0, 1))
        print(f"\n=== stage {self.name}: {status} in {time.time() - self.t0:.0f} s"
              + (f"; failed: {', '.join(self.failed)}" if self.failed else "")
              + (f"; cut short: {', '.join(self.incomplete)}" if self.incomplete else ""), flush=True)
        return 1 if self.failed else 2 if self.incomplete else 0


def _relay(stream, tail) -> None:
    for line in stream:
        print(line, end="", flush=True)
        tail.append(line.rstrip()[:300])


def _stop(proc) -> None:
    """SIGTERM to the step's process group (torch.compile workers included), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _merge_poll(poll, last):
    """Write what ``poll`` returns when it changed; returns the value last written."""
    got = poll() if poll else None
    if got is not None and got != last:
        update(*got)
        return got
    return last


def _commit() -> str:
    if os.environ.get("FP4LIGHTNING_COMMIT"):
        return os.environ["FP4LIGHTNING_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without .git
        return "unknown"


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------- the roofline beside the figures
#: layer-table rows the roofline (benchmarks/roofline.py) predicts: bf16, torchao's row-wise float8,
#: and the FP4 presets on the CUDA default path (scaled_mm); the Triton-path rows have no prediction
PREDICTED = ("bf16", "torchao-float8", "w4a4-direct", "paper")


def roofline(st: Stage | None = None) -> tuple[dict | None, str]:
    """(the roofline's ``--json`` output, where it came from): .whl/roofline.json (gpu_pack.sh runs it
    beforehand), else ``benchmarks/roofline.py --json`` run here inside the stage's time, else None."""
    packed = _read_json(ROOFLINE_JSON)
    if isinstance(packed, dict) and "shapes" in packed:
        return packed, str(ROOFLINE_JSON.relative_to(ROOT))
    script = ROOT / "benchmarks" / "roofline.py"
    if st is None or not script.is_file():
        return None, "no benchmarks/roofline.py" if not script.is_file() else "not run"
    out = st.tmp / "roofline.json"
    out.unlink(missing_ok=True)
    st.run("roofline", ["bash", "-c", f'"{PY}" benchmarks/roofline.py --json > "{out}"'], 90)  # or what is left
    got = _read_json(out)
    return (got, "benchmarks/roofline.py --json") if isinstance(got, dict) and "shapes" in got else \
        (None, "benchmarks/roofline.py --json gave no {'shapes': ...}")


def with_predictions(table: dict, pred: dict | None) -> dict:
    """bench_linear's layer table with each figure as ``{"ms", "x_bf16", "pred_ms", "pred_x_bf16",
    "pred_launches"}`` (the prediction None where the roofline has none)."""
    out = {k: v for k, v in table.items() if k != "layers"}
    out["layers"] = {}
    default_is_scaled = (table.get("paths") or [None])[0] == "scaled_mm"
    for shape, row in table.get("layers", {}).items():
        p = ((pred or {}).get("shapes") or {}).get(shape) or {}
        bf16, pbf16 = row.get("bf16"), (p.get("bf16") or {}).get("pred_ms")
        cells = {}
        for name, ms in row.items():
            q = p.get(name) if name in PREDICTED and (default_is_scaled or name in ("bf16", "torchao-float8")) else None
            pms = (q or {}).get("pred_ms")
            cells[name] = {"ms": ms, "x_bf16": _ratio(ms, bf16), "pred_ms": pms, "pred_x_bf16": _ratio(pms, pbf16),
                           "pred_launches": (q or {}).get("launches")}
        out["layers"][shape] = cells
    return out


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


# --------------------------------------------------------------------------- the stages
NO_AUTOTUNE = {"FP4LIGHTNING_AUTOTUNE": "0"}  # autotuning's compiles would take a stage's time
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--durations=5"]
#: the 1.3B step's rows per stage, one process per precision (its figures land as each finishes):
#: (row, extra args); each row's limit is in STEP_LIMIT_S
STEP_ROWS = {"step": (("bf16-mixed", []), ("fp4", []), ("w4a4-direct", [])),
             "step-torchao": (("torchao-float8", ["--compile-torchao"]),)}
#: benchmarks/profile_linear.py's arguments in the profile stage (its defaults: the three 7B shapes at
#: 8192 tokens, 10 timed calls of each kind, 3 under the profiler, the CUDA graph replay)
PROFILE_ARGS: list[str] = []


def stage_profile(st: Stage) -> None:
    """Where the layer table's time goes, per 7B shape and layer (bf16, w4a4-direct, paper, torchao
    float8): synced and back-to-back wall time, the host's time to issue a call, the kernels' time
    from torch.profiler (GeMMs and the rest, per kernel) beside the roofline's launches, a CUDA graph's
    replay (benchmarks/profile_linear.py)."""
    out = st.tmp / "profile.json"
    out.unlink(missing_ok=True)

    def poll():
        got = _read_json(out)
        return None if got is None else (f"{st.key}/result", got)

    st.run("profile", [PY, "benchmarks/profile_linear.py", *PROFILE_ARGS, "--json", out], env=NO_AUTOTUNE, poll=poll)


def stage_checks(st: Stage) -> None:
    """The device, torch's _scaled_mm kinds (the capability probe), then correctness: every kernel
    against its reference and the scaled_mm backend's tests, compiled."""
    st.run("probe", [PY, str(Path(__file__).resolve()), "probe"])
    st.run("kernel_checks", [PY, "benchmarks/bench_kernels.py", "--checks-only"], env=NO_AUTOTUNE)
    st.run("scaled_mm_tests", PYTEST + ["tests/test_scaled_mm.py", "tests/test_capability_probe.py"], env=NO_AUTOTUNE)


def stage_layers(st: Stage) -> None:
    """bf16 nn.Linear, torchao row-wise float8 and FP4Linear on each GeMM path at the 7B shapes,
    8192 tokens (benchmarks/bench_linear.py --layer-table), each row beside the roofline's prediction."""
    pred, source = roofline()
    table = st.tmp / "layers.json"
    table.unlink(missing_ok=True)

    def poll():
        got = _read_json(table)
        return None if got is None else (f"{st.key}/table", with_predictions(got, pred))

    st.run("table", [PY, "benchmarks/bench_linear.py", "--layer-table", "--iters", "20", "--json", table],
           env=NO_AUTOTUNE, poll=poll)
    if pred is None:
        pred, source = roofline(st)
        if pred is not None and _read_json(table) is not None:
            update(f"{st.key}/table", with_predictions(_read_json(table), pred))
    update(f"{st.key}/roofline", {"source": source, "shapes": (pred or {}).get("shapes")})


def stage_step(st: Stage) -> None:
    """The whole training step of the llama2-1.3b recipe's model, decoder blocks compiled as the recipe
    does: bf16-mixed, fp4 (paper) and w4a4-direct (``step``); torchao float8 row-wise, compiled
    (``step-torchao``; its tokens/s against the ``step`` stage's bf16-mixed row in the record)."""
    update(f"{st.key}/pred", None)  # the roofline models one layer, not a step
    for row, extra in STEP_ROWS[st.name]:
        out = st.tmp / f"step_{row}.json"
        out.unlink(missing_ok=True)

        def poll(out=out, row=row):
            got = _read_json(out)
            if not got or row not in got:
                return None
            return f"{st.key}/rows/{row}", {**got[row], "setup": got.get("setup")}

        st.run(row, [PY, "benchmarks/bench_train.py", "--recipe", RECIPE, "--steps", "3", "--start-micro-batch", "16",
                     "--compile", *extra, "--precisions", row, "--json", out], env=NO_AUTOTUNE, poll=poll)
    rec = read_record()
    rows = rec.get(st.key, {}).get("rows", {})
    base = ((rec.get(KEYS["step"], {}).get("rows") or {}).get("bf16-mixed") or {}).get("tokens_per_s")
    if base:
        update(f"{st.key}/tokens_per_s_vs_bf16", {r: _ratio(v.get("tokens_per_s"), base) for r, v in rows.items()})


def train_metrics(run_dir: Path) -> dict | None:
    """The logged train/* values of a run's newest CSV log: per logged step, and the median tokens/s
    and MFU after the first logged step (which includes the blocks' compile)."""
    logs = sorted(run_dir.glob("logs/csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not logs:
        return None
    with open(logs[-1], newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/tokens_per_sec")]
    logged = [{"step": int(float(r["step"])), "tokens_per_s": float(r["train/tokens_per_sec"]),
               "mfu": float(r["train/mfu"]) if r.get("train/mfu") else None,
               "loss": float(r["train/loss"]) if r.get("train/loss") else None} for r in rows]
    later = logged[1:] or logged
    return {"logged": logged, "tokens_per_s": _median([x["tokens_per_s"] for x in later]),
            "mfu": _median([x["mfu"] for x in later]), "pred": None}


def _median(values: list):
    return sorted(values)[len(values) // 2] if values and None not in values else None


def stage_train(st: Stage) -> None:
    """The user's path: ``fp4lightning train recipes/llama2-1.3b.yaml`` for a few steps on the
    built-in corpus, as a user runs it (its tokens/s and MFU as logged)."""
    run_dir = st.tmp / "run-1.3b"
    cmd = [PY, "-m", "fp4lightning.cli", "train", RECIPE, *TRAIN_OVERRIDES, f"out_dir={run_dir}", "--overwrite"]
    update(f"{st.key}/command", " ".join(["fp4lightning"] + [str(c) for c in cmd[3:]]))

    def poll():
        got = train_metrics(run_dir)
        return None if got is None else (f"{st.key}/metrics", got)

    st.run("train", cmd, env=NO_AUTOTUNE, poll=poll)


def stage_extras(st: Stage) -> None:
    """Around the FP4 layers: the eager 1.3B step's time split, the weight quantized once per step,
    LowPrecisionAdamW's loop against its foreach path."""
    split = st.tmp / "step_eager.json"
    split.unlink(missing_ok=True)
    st.run("step_1.3b_eager", [PY, "benchmarks/bench_train.py", "--recipe", RECIPE, "--steps", "2",
                               "--start-micro-batch", "16", "--precisions", "bf16-mixed,fp4", "--json", split],
           env=NO_AUTOTUNE,
           poll=lambda: None if _read_json(split) is None else (f"{st.key}/step_1.3b_eager", _read_json(split)))
    reuse = st.tmp / "weight_reuse.json"
    reuse.unlink(missing_ok=True)
    st.run("weight_reuse", [PY, "benchmarks/bench_weight_reuse.py", "--device", "cuda", "--tokens", "8192",
                            "--accum", "4", "--json", reuse],
           poll=lambda: None if _read_json(reuse) is None else (f"{st.key}/weight_reuse", _read_json(reuse)))
    st.run("optimizer", [PY, "benchmarks/bench_optim.py", "--step-time", "--step-params", "200", "--step-steps", "10"])


def stage_kernels(st: Stage) -> None:
    """The kernel tests compiled: the GPU tests at realistic sizes, then the small-shape ones."""
    st.run("gpu_tests", PYTEST + ["-m", "gpu", "tests/test_kernels.py"], env=NO_AUTOTUNE)
    st.run("small_tests", PYTEST + ["-m", "not gpu and not slow", "tests/test_kernels.py",
                                    "tests/test_block_kernels.py"], env=NO_AUTOTUNE)


def stage_kernel_bench(st: Stage) -> None:
    """The kernel benchmark's timing rows, autotuning on (benchmarks/bench_kernels.py --skip-checks)."""
    st.run("timings", [PY, "benchmarks/bench_kernels.py", "--skip-checks"])


def stage_memory(st: Stage) -> None:
    """What one llama2-1.3b block saves for its backward, eager and compiled, bf16 against the FP4 layers
    (benchmarks/bench_block_memory.py: the compiled blocks' graph breaks, docs/perf.md); then compiled
    with the partitioner's activation memory budget at 0.5."""
    for name, extra in (("block_memory", []), ("block_memory_budget", ["--memory-budget", "0.5"])):
        out = st.tmp / f"{name}.json"
        out.unlink(missing_ok=True)
        st.run(name, [PY, "benchmarks/bench_block_memory.py", "--device", "cuda", "--json", out] + extra,
               env=NO_AUTOTUNE, poll=lambda out=out, name=name: None if _read_json(out) is None else
               (f"{st.key}/{name}", _read_json(out)))


STAGES = {"profile": stage_profile, "layers": stage_layers, "checks": stage_checks, "step": stage_step,
          "train": stage_train, "step-torchao": stage_step, "extras": stage_extras, "kernels": stage_kernels,
          "kernel-bench": stage_kernel_bench, "memory": stage_memory}


def probe_device() -> int:
    """The ``env`` of the record and the capability probe's answer per ``_scaled_mm`` kind (``checks/probe``)."""
    import torch
    import triton

    from fp4lightning.ops import capability, gemm
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cap = torch.cuda.get_device_capability(dev) if cuda else None
    update("env", {"date": _now(), "commit": _commit(), "python": sys.version.split()[0], "torch": torch.__version__,
                   "triton": triton.__version__, "cuda": torch.version.cuda,
                   "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                   "capability": f"sm_{cap[0]}{cap[1]}" if cap else None})
    routes = gemm.scaled_mm_routes(dev)
    kinds = {capability.kind_name(k): {"refused": routes.refused.get(k),
                                       "route": f"{b} {str(d).removeprefix('torch.')}" if d else b}
             for k, (b, d) in routes.routes.items()}
    update("checks/probe", {"kinds": kinds, "routes_backend": routes.backend,
                            "auto_backend": gemm.backend_for(dev) if cuda else None})
    for name, v in kinds.items():
        print(f"  {name:28s} {'ok' if v['refused'] is None else 'REFUSED (' + v['refused'] + ')'} -> {v['route']}")
    print(f"auto backend on {dev}: {gemm.backend_for(dev) if cuda else 'reference (no GPU)'}")
    return 0 if cuda else 1


def run_stage(name: str) -> int:
    st = Stage(name)
    problems = check_imports(name)
    if problems:
        for p in problems:
            print(f"FATAL {p}", flush=True)
        update(f"{st.key}/imports", problems)
        st.failed.append("imports")
        return st.finish()
    STAGES[name](st)
    return st.finish()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("stage", help="run one stage").add_argument("name", choices=list(STAGES))
    sub.add_parser("imports", help="check what stages import").add_argument("names", nargs="+",
                                                                            choices=list(STAGES))
    sub.add_parser("wheels", help="install the carried wheels").add_argument("--target", required=True, type=Path)
    sub.add_parser("probe", help="the device and its _scaled_mm kinds, into the record")
    args = ap.parse_args(argv)
    if args.cmd == "wheels":
        return install_wheels(args.target)
    load_site()
    if args.cmd == "probe":
        return probe_device()
    if args.cmd == "imports":
        problems = [p for n in args.names for p in check_imports(n)]
        print("\n".join(problems) if problems else f"imports of {', '.join(args.names)}: ok")
        return 1 if problems else 0
    return run_stage(args.name)


if __name__ == "__main__":
    sys.exit(main())
