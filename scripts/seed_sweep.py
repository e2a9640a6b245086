"""Threshold audit: run every seeded threshold of the numeric tests under N fixed seeds and state
each threshold's margin (tests/README.md, "Threshold policy"). Not part of CI.

Pass 1 runs the numeric test modules once (seed 0) with FP4_MARGIN_LOG set, to find the tests
that check a seeded threshold (tests/_numerics.py: ``above``, ``below``, ``close``). Pass 2 runs
only those tests under seeds S..S+N-1, in chunks, ``--jobs`` pytest processes at a time, every
threshold appending its measured value to a log. The report gives, per threshold (test, source
line, what), the number of seeds, the bound, the worst value seen, its seed and the margin.

    python scripts/seed_sweep.py 1000 --jobs 2 --out /tmp/sweep     # the audit
    python scripts/seed_sweep.py 1000 --out /tmp/sweep --resume      # go on after an interruption
    python scripts/seed_sweep.py --report /tmp/sweep                # re-print a finished one

A failure prints its seed; reproduce it with FP4_TEST_SEED=<seed> bash scripts/test.sh -k <test>.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import NUMERIC_MODULES  # noqa: E402

_SEED = re.compile(r"\[seed(\d+)-?")


def _pytest(args: list[str], log: Path, out: Path) -> int:
    env = dict(os.environ, FP4_MARGIN_LOG=str(log), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    env.pop("FP4_TEST_SEED", None)
    # --jobs processes side by side on small tensors: one intra-op thread each (two threads per
    # process oversubscribe a 2-core machine; measured: one thread each ran the sweep
    # about 1.4x faster)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    with open(out, "w", encoding="utf-8") as f:
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                               cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _records(out_dir: Path):
    for log in sorted(out_dir.glob("margins-*.jsonl")):
        for line in log.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)


def _function_ids(out_dir: Path) -> list[str]:
    """Function-level node ids (no parameters) of the tests that logged a threshold."""
    return sorted({r["test"].split("[", 1)[0] for r in _records(out_dir)})


def report(out_dir: Path) -> int:
    groups: dict[tuple, dict] = {}
    for r in _records(out_dir):
        m = _SEED.search(r["test"])
        if not m:
            continue  # the discovery pass (no sweep seed)
        seed = int(m.group(1))
        test = _SEED.sub("[", r["test"]).replace("[]", "")
        key = (test, r["site"], r["what"])
        g = groups.setdefault(key, {"op": r["op"], "bound": r["bound"], "seeds": set(), "worst": None,
                                    "worst_seed": None, "fails": set()})
        g["seeds"].add(seed)
        v, low = r["value"], r["op"] == ">"
        if g["worst"] is None or (v < g["worst"] if low else v > g["worst"]):
            g["worst"], g["worst_seed"] = v, seed
        passed = {">": v > r["bound"], "<": v < r["bound"], "<=": v <= r["bound"]}[r["op"]]
        if not passed:
            g["fails"].add(seed)
    rows, n_fail = [], 0
    for (test, site, what), g in sorted(groups.items()):
        margin = g["worst"] - g["bound"] if g["op"] == ">" else g["bound"] - g["worst"]
        n_fail += bool(g["fails"])
        rows.append({"test": test, "site": site, "what": what, "op": g["op"], "bound": g["bound"],
                     "seeds": len(g["seeds"]), "seed_min": min(g["seeds"]), "seed_max": max(g["seeds"]),
                     "worst": g["worst"], "worst_seed": g["worst_seed"], "margin": margin,
                     "failed_seeds": sorted(g["fails"])[:20], "n_failed": len(g["fails"])})
    (out_dir / "margins.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    lines = ["| test | line | threshold | seeds | worst (seed) | margin |", "|---|---|---|---|---|---|"]
    for r in rows:
        fail = f" **{r['n_failed']} failed** {r['failed_seeds']}" if r["n_failed"] else ""
        lines.append(f"| `{r['test'].split('::', 1)[1]}` | {r['site']} | {r['what']} {r['op']} {r['bound']:.4g} | "
                     f"{r['seeds']} | {r['worst']:.4g} ({r['worst_seed']}) | "
                     f"{r['margin']:.3g}{fail} |")
    text = "\n".join(lines) + "\n"
    (out_dir / "report.md").write_text(text, encoding="utf-8")
    print(text)
    # one row per test function: its tightest threshold (smallest margin relative to the bound's size)
    by_fn: dict[str, list] = defaultdict(list)
    for r in rows:
        by_fn[r["test"].split("[", 1)[0]].append(r)
    short = ["| test | thresholds | seeds | tightest threshold | worst (seed) | margin |", "|---|---|---|---|---|---|"]
    for fn, rs in sorted(by_fn.items()):
        t = min(rs, key=lambda r: r["margin"] / max(abs(r["bound"]), 1.0))
        name = fn.split("::", 1)[1]
        case = t["test"].split("[", 1)[1].rstrip("]") if "[" in t["test"] else ""
        short.append(f"| `{fn.rsplit('/', 1)[-1].split('::')[0]}::{name}` | {len(rs)} | {min(r['seeds'] for r in rs)} | "
                     f"{t['what']} {t['op']} {t['bound']:.4g}{f' [{case}]' if case else ''} | "
                     f"{t['worst']:.4g} ({t['worst_seed']}) | {t['margin']:.3g} |")
    (out_dir / "summary.md").write_text("\n".join(short) + "\n", encoding="utf-8")
    seeds = sorted({s for g in groups.values() for s in g["seeds"]})
    print(f"{len(rows)} thresholds, {len(seeds)} seeds ({seeds[0] if seeds else '-'}..{seeds[-1] if seeds else '-'}), "
          f"{n_fail} with failures; {out_dir / 'margins.json'}")
    return 1 if n_fail else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, nargs="?", default=1000, help="number of seeds (default 1000)")
    ap.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--jobs", type=int, default=2, help="pytest processes at a time (default 2)")
    ap.add_argument("--chunk", type=int, default=50, help="seeds per pytest process (default 50)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: a new temporary folder)")
    ap.add_argument("--modules", nargs="*", default=None,
                    help="test modules to sweep (default: every numeric module, tests/conftest.py)")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression to narrow the tests")
    ap.add_argument("--tag", default="", help="name this run's files in OUT (several sweeps, e.g. of different "
                    "--modules, can share one OUT and one report)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse OUT's discovery pass and skip the chunks OUT already finished")
    ap.add_argument("--report", type=Path, default=None, metavar="OUT", help="only print the report of OUT")
    args = ap.parse_args(argv)
    if args.report is not None:
        if not args.report.is_dir():
            ap.error(f"--report {args.report}: no such folder (give the --out of a sweep)")
        return report(args.report)
    if args.n < 1 or args.jobs < 1 or args.chunk < 1:
        ap.error("n, --jobs and --chunk must be at least 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="fp4-seed-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    modules = args.modules or [f"tests/{m}.py" for m in NUMERIC_MODULES]
    t0 = time.time()
    narrow = ["-k", args.keyword] if args.keyword else []
    tag = f"{args.tag}-" if args.tag else ""
    disc = out / f"discovery{'-' + args.tag if args.tag else ''}.jsonl"
    if args.resume and disc.exists():
        rc = 0
    else:
        disc.unlink(missing_ok=True)
        rc = _pytest(modules + narrow + ["-x"], disc, disc.with_suffix(".txt"))
    tests = sorted({r["test"].split("[", 1)[0] for r in map(json.loads, disc.read_text().splitlines())}) \
        if disc.exists() else []
    if rc != 0 or not tests:
        print(f"discovery pass failed (rc {rc}); see {disc.with_suffix('.txt')}", file=sys.stderr)
        return 2
    print(f"{len(tests)} tests check a seeded threshold (discovery {time.time() - t0:.0f} s); sweeping seeds "
          f"{args.start}..{args.start + args.n - 1} into {out}", flush=True)
    starts = range(args.start, args.start + args.n, args.chunk)

    def chunk(s: int) -> int:
        n = min(args.chunk, args.start + args.n - s)
        done = out / f"pytest-{tag}{s:07d}.txt"
        if args.resume and done.exists() and re.search(r"\d+ (passed|failed).* in [0-9.]+s", done.read_text()):
            print(f"seeds {s}..{s + n - 1}: done before, kept", flush=True)
            return 0 if " failed" not in done.read_text().splitlines()[-1] else 1
        (out / f"margins-{tag}{s:07d}.jsonl").unlink(missing_ok=True)  # a cut-off chunk starts over
        t = time.time()
        rc = _pytest(tests + narrow + ["--seed-sweep", str(n), "--seed-sweep-start", str(s)],
                     out / f"margins-{tag}{s:07d}.jsonl", done)
        tail = done.read_text(encoding="utf-8").strip().splitlines()[-1:]
        print(f"seeds {s}..{s + n - 1}: rc {rc}, {time.time() - t:.0f} s, {tail[0] if tail else ''}", flush=True)
        return rc

    with ThreadPoolExecutor(args.jobs) as pool:
        rcs = list(pool.map(chunk, starts))
    print(f"sweep took {time.time() - t0:.0f} s", flush=True)
    return max(report(out), 1 if any(rcs) else 0)


if __name__ == "__main__":
    sys.exit(main())
