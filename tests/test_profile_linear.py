"""benchmarks/profile_linear.py on CPU at a tiny shape: what the GPU check's ``profile`` stage records.

The stage has one lent-GPU window to say where FP4Linear's time goes (issue 47); here the same code
runs end to end (on CPU the profiler's "busy" time is the ops' CPU self time) and the record's
structure and arithmetic are checked: every figure positive, the per-kernel list adding up to the
busy total, GeMMs plus the rest to the same total, the busy time inside the profiled wall time, and
the GeMMs the profiler saw matching the roofline's GeMM launches.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["bf16", "w4a4-direct", "paper", "torchao-float8"]


@pytest.fixture(scope="module")
def profile_linear():
    spec = importlib.util.spec_from_file_location("profile_linear", ROOT / "benchmarks" / "profile_linear.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("profile_linear", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def record(profile_linear, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    got = profile_linear.run("64x128x256", "cpu", iters=2, calls=2, graphs=True, json_path=str(path), top=3)
    assert json.loads(path.read_text()) == json.loads(json.dumps(got))  # the file is what the run returned
    return got


def test_the_record_names_the_device_and_what_busy_means_on_it(record):
    assert record["device"] == "cpu" and record["fp4_backend"] == "scaled_mm"
    assert "CPU op self time" in record["busy_is"] and "no GPU" in record["busy_is"]
    assert record["iters"] == 2 and record["profiled_calls"] == 2
    assert list(record["shapes"]) == ["128x256"] and record["shapes"]["128x256"]["tokens"] == 64
    assert list(record["shapes"]["128x256"]["layers"]) == LAYERS


def _measured(record):
    layers = record["shapes"]["128x256"]["layers"]
    # torchao is a test-only extra: without it its row says why, every other row is measured
    assert "error" not in layers["torchao-float8"] or "torchao" in layers["torchao-float8"]["error"]
    return {name: r for name, r in layers.items() if "error" not in r}


def test_every_figure_is_positive_and_the_kernels_add_up(record):
    measured = _measured(record)
    assert {"bf16", "w4a4-direct", "paper"} <= set(measured)
    for name, r in measured.items():
        for key in ("sync_ms", "b2b_ms", "host_ms", "profiled_ms", "busy_ms", "gemm_ms"):
            assert r[key] > 0, (name, key, r[key])
        assert r["other_ms"] >= 0 and r["bound"] is None  # on CPU everything is host time
        assert r["peak_mb"] is None  # the CPU allocator keeps no high-water mark
        ks = r["kernels"]
        assert ks and all(k["kind"] in ("gemm", "other") and k["per_call"] > 0 and k["us_per_call"] >= 0 for k in ks)
        assert [k["us_per_call"] for k in ks] == sorted((k["us_per_call"] for k in ks), reverse=True)
        total = sum(k["us_per_call"] for k in ks) / 1e3
        assert total == pytest.approx(r["busy_ms"], abs=1e-3 + 1e-3 * len(ks) / 1e3), name
        assert r["gemm_ms"] + r["other_ms"] == pytest.approx(r["busy_ms"], abs=2e-4), name
        assert r["gemm_ms"] == pytest.approx(sum(k["us_per_call"] for k in ks if k["kind"] == "gemm") / 1e3, abs=1e-3)
        assert r["kernels_per_call"] == pytest.approx(sum(k["per_call"] for k in ks), abs=0.01 * len(ks))
        # the ops' self times are disjoint stretches of the profiled calls
        assert r["busy_ms"] <= 1.05 * r["profiled_ms"] + 0.05, name
        assert r["graph_ms"] is None and "CPU" in r["graph_error"]


def test_the_gemms_seen_match_the_roofline_s_gemm_launches(record):
    for name, r in _measured(record).items():
        pred = r["pred"]
        assert pred["ms"] > 0 and pred["gemm_ms"] + pred["other_ms"] == pytest.approx(pred["ms"], abs=2e-4)
        assert pred["launches"] == sum(x["launches"] for x in pred["launch_list"])
        assert (pred["peak_mib"] is None) == (name == "torchao-float8") and (pred["peak_mib"] or 1) > 0, name
        pred_gemms = sum(x["launches"] for x in pred["launch_list"] if x["kind"] == "gemm")
        seen = {k["name"]: k["per_call"] for k in r["kernels"] if k["kind"] == "gemm"}
        # forward, dgrad, wgrad: nn.Linear's addmm + 2 mm; the FP4 layers' three _scaled_mm (on CPU,
        # torch's _scaled_mm runs an aten::mm inside each)
        if name == "bf16":
            assert seen == {"aten::addmm": 1, "aten::mm": 2} and pred_gemms == 3
        else:
            assert seen["aten::_scaled_mm"] == pred_gemms == 3, (name, seen)


def test_the_table_is_printed_layer_by_layer(profile_linear, capsys, monkeypatch):
    monkeypatch.delenv("FP4LIGHTNING_BACKEND", raising=False)
    got = profile_linear.run("32x64x32", "cpu", iters=1, calls=1, graphs=False, json_path=None, top=2,
                             names=("bf16", "paper"))
    assert got["fp4_backend"] == "scaled_mm" and "FP4LIGHTNING_BACKEND" not in os.environ  # set for the run only
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "reference")  # a backend asked for is kept
    assert profile_linear.run("32x64x32", "cpu", iters=1, calls=1, graphs=False, names=("paper",))["fp4_backend"] \
        == "reference"
    out = capsys.readouterr().out
    assert "busy = CPU op self time per call" in out
    rows = [line for line in out.splitlines() if line.startswith("| 64x32 |")]
    assert [r.split(" | ")[1] for r in rows] == ["bf16", "paper", "paper"] and all(r.count("|") == 15 for r in rows)
    assert "CUDA graph" not in out  # --no-graph


@pytest.mark.parametrize("args, message", [
    (["--layers", "bf17"], "--layers: unknown bf17"),
    (["--shapes", "1x2"], "give MxKxN triples"),
    (["--shapes", "8x100x64"], "FP4Linear cannot take it (in_features=100"),
])
def test_bad_arguments_get_one_line_and_exit_status_2(profile_linear, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        profile_linear.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
