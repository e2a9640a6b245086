"""The numerics fingerprint (fp4lightning.train.fingerprint) and the paired statistics
(fp4lightning.experiments.stats) that compare / compare-join report."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from fp4lightning.config import FP4Config
from fp4lightning.experiments.stats import paired_t, t_quantile, t_two_sided_p, verdict
from fp4lightning.train.fingerprint import disagreement, fingerprint_of_recipe, numerics_fingerprint
from fp4lightning.train.recipe import load_recipe


def test_fingerprint_is_stable_and_sees_a_change_of_numbers():
    """Same calls, same hash (in this process and in a fresh one); a changed quantizer setting, state
    layout or wire format changes exactly its part; a changed division order in a path would do the same."""
    paper = FP4Config.from_preset("paper")
    a = numerics_fingerprint("cpu", "bfloat16", paper, "fp16", "e4m3")
    assert set(a["parts"]) == {"high", "fp4", "states", "comm"}
    assert numerics_fingerprint("cpu", "bfloat16", paper, "fp16", "e4m3") == a
    assert disagreement(a, a) is None
    code = ("import json; from fp4lightning.config import FP4Config; from fp4lightning.train.fingerprint import "
            "numerics_fingerprint as f; print(json.dumps(f('cpu', 'bfloat16', FP4Config.from_preset('paper'), "
            "'fp16', 'e4m3')))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == a
    b = numerics_fingerprint("cpu", "bfloat16", FP4Config.from_preset("paper", occ_alpha=0.98), "fp16", "e4m3")
    assert b["parts"]["high"] == a["parts"]["high"] and b["parts"]["fp4"] != a["parts"]["fp4"]
    assert disagreement(a, b) == "the fp4 path's numbers"
    c = numerics_fingerprint("cpu", "bfloat16", paper, "fp8-fp16", "e5m2")
    assert disagreement(a, c) == "the comm path's numbers; the states path's numbers"
    # a bf16 run shares the high-precision path and the environment with an FP4 run: they may be paired
    bf16 = numerics_fingerprint("cpu", "bfloat16")
    assert set(bf16["parts"]) == {"high"} and disagreement(a, bf16) is None
    # another environment (torch build, CPU kernels) is named
    moved = {**bf16, "env": {**bf16["env"], "cpu_kernels": "AVX2"}}
    assert disagreement(bf16, moved) == f"cpu_kernels {bf16['env']['cpu_kernels']} vs AVX2"
    assert disagreement(None, bf16) == "no numerics fingerprint recorded"


def test_a_run_resumed_with_other_numerics_is_marked(tmp_path, capsys):
    """numerics.json of a run resumed under other numerics keeps the first part's: it pairs with nothing."""
    from fp4lightning.train.fingerprint import read_fingerprint, record_fingerprint

    cfg = load_recipe(None, ["trainer.precision=bf16-mixed"])
    first = record_fingerprint(cfg, "cpu", tmp_path)
    assert read_fingerprint(tmp_path) == first and "resumed_from" not in record_fingerprint(cfg, "cpu", tmp_path)
    (tmp_path / "numerics.json").write_text(json.dumps({**first, "hash": "0" * 16, "parts": {"high": "other"}}))
    again = record_fingerprint(cfg, "cpu", tmp_path)
    assert "started with other numerics (the high path's numbers)" in capsys.readouterr().out
    assert read_fingerprint(tmp_path)["resumed_from"]["parts"] == {"high": "other"}
    assert disagreement(again, first).startswith("a run resumed with other numerics than it started with")


def test_fingerprint_leaves_the_runs_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    numerics_fingerprint("cpu", "bfloat16", FP4Config.from_preset("w4a4-direct"))
    assert torch.equal(torch.rand(4), expected)


def test_fingerprint_of_recipe_covers_the_paths_it_trains_through():
    cfg = load_recipe(None, ["trainer.precision=fp4", "optimizer.states=fp16", "trainer.grad_comm=fp8-e4m3"])
    fp = fingerprint_of_recipe(cfg)
    assert set(fp["parts"]) == {"high", "fp4", "states", "comm"}
    assert set(fingerprint_of_recipe(load_recipe(None, ["trainer.precision=bf16-mixed"]))["parts"]) == {"high"}
    # fp32 runs no autocast: another high-precision path
    fp32 = fingerprint_of_recipe(load_recipe(None, ["trainer.precision=32-true"]))
    assert fp32["parts"]["high"] != fp["parts"]["high"]


def test_paired_t_matches_scipy():
    """t, two-sided p and the 95% interval against scipy's Student t on fresh random gaps."""
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random()
    for n in (2, 3, 5, 10):
        gaps = [rng.gauss(0.002, 0.004) for _ in range(n)]
        got = paired_t(gaps)
        ref = stats.ttest_1samp(gaps, 0.0)
        assert got["t"] == pytest.approx(float(ref.statistic), rel=1e-12)
        assert got["p"] == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-15)
        lo, hi = stats.t.interval(0.95, n - 1, loc=got["mean"], scale=stats.sem(gaps))
        assert got["ci95"] == pytest.approx([lo, hi], rel=1e-9)
    for df in (1, 2, 4, 30):
        assert t_quantile(0.975, df) == pytest.approx(float(stats.t.ppf(0.975, df)), rel=1e-10)
        for t in (0.3, 2.0, 4.3, 12.0):
            assert t_two_sided_p(t, df) == pytest.approx(float(2 * stats.t.sf(t, df)), rel=1e-9, abs=1e-15)


def test_resolved_needs_p_below_005_not_two_standard_errors():
    """Three seeds whose mean is 2.9 standard errors from zero were 'resolved' by the old rule (|mean| > 2
    SE); Student's t with 2 degrees of freedom gives p = 0.10: not resolved, and the interval it rules out."""
    gaps = [0.004, 0.010, 0.016]
    t = paired_t(gaps)
    assert abs(t["mean"]) > 2 * t["std"] / math.sqrt(3) and t["p"] > 0.05
    assert verdict(t).startswith("not resolved (p = ") and "no difference larger than" in verdict(t)
    assert verdict(paired_t([0.010, 0.011, 0.0105])) == "resolved (p < 0.001)"
    assert verdict(paired_t([0.01])) == "n/a (1 seed)"


def test_two_fp4_recipes_pair_on_the_paths_they_share(tmp_path):
    """``compare --variants nvfp4,mxfp4`` trained every run and then refused to pair them ("did not compute
    the same numbers (the fp4 path's numbers)"): two FP4 recipes' ``fp4`` parts differ on every machine. The
    parts a pair's recipes choose apart are left out; the environment and the shared parts still decide."""
    from fp4lightning.experiments.compare import join_summaries
    from fp4lightning.train.fingerprint import parts_set_apart

    nv, mx = ["trainer.precision=fp4", "fp4.preset=nvfp4"], ["trainer.precision=fp4", "fp4.preset=mxfp4"]
    fp = {o[1]: numerics_fingerprint("cpu", "bfloat16", FP4Config.from_preset(o[1].split("=")[1])) for o in (nv, mx)}
    a, b = fp["fp4.preset=nvfp4"], fp["fp4.preset=mxfp4"]
    assert disagreement(a, b) == "the fp4 path's numbers"
    assert parts_set_apart(nv, mx) == {"fp4"} and disagreement(a, b, parts_set_apart(nv, mx)) is None
    assert parts_set_apart(nv, nv) == set()
    moved = {**b, "env": {**b["env"], "cpu_kernels": "AVX2"}}  # another machine is still named
    assert disagreement(a, moved, {"fp4"}) == f"cpu_kernels {a['env']['cpu_kernels']} vs AVX2"
    other_high = {**b, "parts": {**b["parts"], "high": "0" * 16}}  # so is another high-precision path
    assert disagreement(a, other_high, {"fp4"}) == "the high path's numbers"
    states = ["trainer.precision=fp4", "fp4.preset=paper", "optimizer.states=fp16"]
    assert parts_set_apart(states, [*states[:2], "optimizer.states=fp8-fp16"]) == {"states"}
    assert parts_set_apart(states, [*states[:2], "trainer.grad_comm=fp8-e4m3"]) == {"states", "comm"}

    def summary(name, overrides, fingerprint, losses):
        doc = {"recipe": "recipes/tiny.yaml", "steps": 400, "tokens": 1, "run_set": {"model.name": "tiny"},
               "variants": {name: {"preset": name, "lr": 0.002, "seeds": [1, 2, 3], "overrides": overrides,
                                   "numerics": [fingerprint] * 3, "final_val_loss": losses}}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        return path

    paths = [summary("nvfp4", nv, a, [4.86, 4.88, 4.87]), summary("mxfp4", mx, b, [4.91, 4.90, 4.92])]
    joined, table = join_summaries(paths, reference="mxfp4")
    assert "| same |" in table, table
    with pytest.raises(Exception, match="did not compute the same numbers .*cpu_kernels"):
        join_summaries([paths[0], summary("mxfp4", mx, moved, [4.91, 4.90, 4.92])], reference="mxfp4")
