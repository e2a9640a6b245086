"""`fp4lightning compare` on a two-seed, two-variant, few-step run: PNGs, tables and
summary.json appear (a smoke test of the tool, not a result), and the OCC fidelity report works on real activations."""
from __future__ import annotations

import json
import shutil
import statistics

import pytest
import torch

from fp4lightning.experiments.occ_fidelity import VARIANTS, capture_linear_inputs, occ_fidelity_report
from fp4lightning.experiments.format_fidelity import ACT_FORMATS, GRAD_FORMATS
from fp4lightning.cli import main as cli_main
from fp4lightning.experiments.compare import parse_variant, variant_overrides
from fp4lightning.experiments.dge_probe import read_probe
from fp4lightning.models.llama import Llama, llama_config
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides


def test_variant_overrides_and_errors():
    assert variant_overrides("bf16") == ["trainer.precision=bf16-mixed"]
    assert variant_overrides("fp4") == ["trainer.precision=fp4", "fp4.preset=paper"]
    assert variant_overrides("fp4-no-dge")[-1] == "fp4.preset=fp4-no-dge"
    with pytest.raises(ValueError, match="unknown variant 'fp3'"):
        variant_overrides("fp3")
    assert variant_overrides("bf16@lr=1e-3") == ["trainer.precision=bf16-mixed", "optimizer.lr=0.001"]
    assert variant_overrides("fp4-dge-frozen") == ["trainer.precision=fp4", "fp4.preset=fp4-no-dge",
                                                   "fp4.overrides.dge_frozen_factor=true"]
    # the rest of the paper's method on top of `paper`: states, the gradient exchange, both
    paper = ["trainer.precision=fp4", "fp4.preset=paper"]
    # fp4+states / fp4+all: the LLaMA-2 recipes' FP16 moments; the -fp8 variants the released code's layout
    assert variant_overrides("fp4+states") == [*paper, "optimizer.states=fp16"]
    assert variant_overrides("fp4+states-fp8") == [*paper, "optimizer.states=fp8-fp16"]
    assert variant_overrides("fp4+comm") == [*paper, "trainer.grad_comm=fp8-e4m3"]
    assert variant_overrides("fp4+all@lr=1e-3") == [*paper, "optimizer.states=fp16", "trainer.grad_comm=fp8-e4m3",
                                                    "optimizer.lr=0.001"]
    assert variant_overrides("fp4+all-fp8") == [*paper, "optimizer.states=fp8-fp16", "trainer.grad_comm=fp8-e4m3"]
    assert parse_variant("fp4+all").preset == "fp4+all"  # summary.json tells it from `paper`
    with pytest.raises(ValueError, match=r"unknown variant 'fp4\+foo'.*fp4\+states, fp4\+states-fp8, fp4\+comm"):
        variant_overrides("fp4+foo")


def test_reuse_and_run_set_see_the_method_keys(tmp_path, capsys):
    """--reuse starts a run over when its recorded optimizer.states / trainer.grad_comm differ; a config.yaml
    written before those keys counts as what its run trained with (fp32 states; one device: no rounding, as
    fp32; several devices, FP4 over DDP: FP8 E4M3); summary.json's run set records both, and compare-join
    reads a run set from before them as fp32 on one device."""
    from fp4lightning.experiments.compare import _run_set, join_summaries, reuse_decision
    from fp4lightning.errors import UsageError
    from fp4lightning.train.recipe import load_recipe, recipe_to_yaml

    def recorded(cfg, drop=False):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(b"")
        (run / "compare_wall.json").write_text('{"wall_s": 1.0}')
        text = recipe_to_yaml(cfg)
        if drop:  # as written before the keys existed
            text = "\n".join(line for line in text.splitlines() if not line.strip().startswith(("states:", "grad_comm:")))
        (run / "config.yaml").write_text(text)
        return run

    fp32 = load_recipe(None, [])
    assert reuse_decision(recorded(fp32), fp32)[0] == "reuse"
    action, why = reuse_decision(recorded(fp32), load_recipe(None, ["optimizer.states=fp8-fp16"]))
    assert action == "train" and "optimizer.states fp32 -> fp8-fp16" in why
    action, why = reuse_decision(recorded(fp32), load_recipe(None, ["trainer.grad_comm=fp8-e4m3"]))
    assert action == "train" and "trainer.grad_comm fp32 -> fp8-e4m3" in why
    assert reuse_decision(recorded(fp32, drop=True), fp32)[0] == "reuse"
    two = ["trainer.devices=2", "data.micro_batch_size=8"]
    action, why = reuse_decision(recorded(load_recipe(None, two), drop=True), load_recipe(None, two))
    assert action == "train" and "trainer.grad_comm fp8-e4m3 -> fp32" in why
    run_set = _run_set(load_recipe(None, ["optimizer.states=fp8-fp16"]))
    assert run_set["optimizer.states"] == "fp8-fp16" and run_set["trainer.grad_comm"] == "fp32"

    def summary(name, run_set):
        doc = {"recipe": "r.yaml", "steps": 4, "tokens": 16, "run_set": run_set,
               "variants": {"fp4": {"preset": "paper", "lr": 2e-3, "seeds": [len(name)], "final_val_loss": [5.0]}}}
        (tmp_path / name).write_text(json.dumps(doc))
        return tmp_path / name

    new = _run_set(fp32)
    old = {k: v for k, v in new.items() if k not in ("optimizer.states", "trainer.grad_comm")}
    joined, _ = join_summaries([summary("new.json", new), summary("old-1.json", old)])
    assert joined["variants"]["fp4"]["seeds"] == [8, 10]
    assert "old-1.json predates optimizer.states, trainer.grad_comm" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"optimizer\.states: 'fp16' in .*, 'fp32' here"):
        join_summaries([summary("states.json", {**new, "optimizer.states": "fp16"}), summary("old-2.json", old)])
    # trainer.compile came later still: a run set without it compiled nothing (false)
    before_compile = {k: v for k, v in new.items() if k != "trainer.compile"}
    assert new["trainer.compile"] is False
    joined, _ = join_summaries([summary("old-3.json", before_compile), summary("new-2.json", new)])
    assert joined["run_set"]["trainer.compile"] is False
    assert "old-3.json predates trainer.compile; its runs trained with trainer.compile=False" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"trainer\.compile: True in .*, False here"):
        join_summaries([summary("compiled.json", {**new, "trainer.compile": True}), summary("old-4.json", before_compile)])


@pytest.mark.slow
def test_compare_seeds_through_cli(tmp_path_factory, capsys):
    """2 seeds x 2 variants, a few steps, through the real CLI: every output appears, the
    statistics are those of the per-seed values, and within a seed both variants start from
    the same weights while the seeds start from different ones (the DGE probe's step-0 record)."""
    corpus = prepared_test_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("compare")
    args = ["compare", *tiny_overrides(corpus, out / "unused", "schedule.max_steps=4", "trainer.val_every_n_steps=2",
                                       "model.max_seq_len=512", "seed=7"),
            "--variants", "bf16,fp4@lr=3e-3", "--seeds", "2", "--dge-probe", "2", "--out", str(out),
            "--eval-limit", "2"]
    assert cli_main(args) == 0
    png = out / "loss_curves.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert (out / "dge_probe.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "comparison.md").read_text()
    assert "| bf16 |" in md and "| fp4@lr=3e-3 |" in md and "vs bf16" in md and " ± " in md
    assert "seed 7 | seed 8" in md and "Zero-shot" in md and "OCC fidelity" in md and "DGE probe" in md
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"recipe", "steps", "tokens", "variants", "run_set"}
    assert summary["run_set"]["model.max_seq_len"] == 512 and "seed" not in summary["run_set"]
    assert len(summary["run_set"]["data.fingerprint"]) == 64  # the corpus by content (data.data_fingerprint)
    assert "| fp4l_cloze | acc_norm (%) |" in md  # percent, as `fp4lightning eval` prints it
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 4 * 64
    assert set(summary["variants"]) == {"bf16", "fp4@lr=3e-3"}
    for name, preset, lr in (("bf16", "bf16", 1e-2), ("fp4@lr=3e-3", "paper", 3e-3)):
        v = summary["variants"][name]
        assert set(v) == {"preset", "lr", "seeds", "overrides", "numerics", "final_val_loss", "mean", "std"}
        assert (v["preset"], v["lr"], v["seeds"]) == (preset, lr, [7, 8])
        # every run's numerics fingerprint, computed at its start: both seeds computed the same numbers
        assert len(v["numerics"]) == 2 and v["numerics"][0] == v["numerics"][1]
        assert set(v["numerics"][0]["parts"]) == ({"high"} if preset == "bf16" else {"high", "fp4"})
        assert len(v["final_val_loss"]) == 2 and v["final_val_loss"][0] != v["final_val_loss"][1]
        assert v["mean"] == pytest.approx(statistics.fmean(v["final_val_loss"]))
        assert v["std"] == pytest.approx(statistics.stdev(v["final_val_loss"]))
    full = json.loads((out / "comparison.json").read_text())
    assert full["variants"]["fp4@lr=3e-3"]["numerics_vs_reference"] == "same"
    assert "paired t-test" in md and "95% interval" in md
    gap = full["variants"]["fp4@lr=3e-3"]["val_gap"]["values"]
    bf16, fp4 = (summary["variants"][n]["final_val_loss"] for n in ("bf16", "fp4@lr=3e-3"))
    assert gap == pytest.approx([f / b - 1 for f, b in zip(fp4, bf16)])
    assert full["variants"]["bf16"]["runs"][1]["zero_shot"]
    assert len(full["occ_fidelity"]["rows"]) == len(VARIANTS)
    # the same tables from a checkpoint alone, the OCC one with the E4M3-folded compensation rows
    ckpt = full["variants"]["bf16"]["runs"][0]["checkpoint"]
    capsys.readouterr()
    assert cli_main(["occ-fidelity", ckpt, "--data", str(corpus), "--seq-len", "64", "--e4m3-fold"]) == 0
    table = capsys.readouterr().out
    assert "| clamp + comp, alpha=0.99 |" in table and "| clamp + comp folded in E4M3, alpha=0.99 |" in table
    assert cli_main(["occ-fidelity", ckpt + ".missing", "--data", str(corpus)]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli_main(["format-fidelity", ckpt, "--data", str(corpus), "--seq-len", "64"]) == 0
    table = capsys.readouterr().out
    assert table.count("| gradients (dY) |") == len(GRAD_FORMATS) and "| weights | NVFP4, 16 x 16 tiles |" in table
    first = {(v, s): read_probe(out / v / f"seed{s}" / "dge_probe.jsonl")[0] for v in ("bf16", "fp4@lr=3e-3")
             for s in (7, 8)}
    assert all(r["step"] == 0 for r in first.values())
    assert first["bf16", 7]["rel_err"] == first["fp4@lr=3e-3", 7]["rel_err"]  # same init within a seed
    assert first["bf16", 8]["rel_err"] == first["fp4@lr=3e-3", 8]["rel_err"]
    assert first["bf16", 7]["rel_err"] != first["bf16", 8]["rel_err"]  # a new init per seed
    assert read_probe(out / "bf16" / "seed7" / "dge_probe.jsonl")[-1]["step"] == 4
    assert "Quantization fidelity of every FP4 format" in md and "NVFP4" in md
    assert len(full["block_fidelity"]["activations"]) == len(ACT_FORMATS)
    assert len(full["block_fidelity"]["gradients"]) == len(GRAD_FORMATS) and "gradients (dY)" in md
    # compare-join: the summary split by seed (as if each seed had run on its own machine) joins back
    # into the same per-seed values, mean, std and paired gaps
    parts = []
    for i, seed in enumerate((7, 8)):
        part = {**summary, "variants": {n: {**v, "seeds": [seed], "final_val_loss": [v["final_val_loss"][i]],
                                            "mean": v["final_val_loss"][i], "std": None}
                                        for n, v in summary["variants"].items()}}
        (out / f"part{seed}.json").write_text(json.dumps(part))
        parts.append(str(out / f"part{seed}.json"))
    assert cli_main(["compare-join", *parts, "--out", str(out / "joined.json")]) == 0
    joined = json.loads((out / "joined.json").read_text())
    assert joined["reference"] == "bf16"
    for name, v in summary["variants"].items():
        j = joined["variants"][name]
        assert (j["seeds"], j["final_val_loss"]) == ([7, 8], v["final_val_loss"])
        assert j["mean"] == pytest.approx(v["mean"]) and j["std"] == pytest.approx(v["std"])
    assert joined["variants"]["fp4@lr=3e-3"]["val_gap_vs_reference"]["values"] == pytest.approx(gap)


@pytest.mark.slow
def test_compare_reuse_resumes_a_cut_off_run(tmp_path_factory, capsys):
    """--reuse skips a finished run, and continues one that was cut off (last.ckpt but no
    compare_wall.json) from its checkpoint instead of counting it as finished."""
    corpus = prepared_test_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("compare-reuse")

    def run(steps, *extra):
        args = ["compare", *tiny_overrides(corpus, out / "unused", f"schedule.max_steps={steps}",
                                           "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2"),
                "--variants", "bf16", "--out", str(out), "--eval-tasks", "none", "--no-occ-report", *extra]
        assert cli_main(args) == 0
        return capsys.readouterr().out

    run(2)
    run_dir = out / "bf16" / "seed1234"
    (run_dir / "compare_wall.json").unlink()  # as if the job had been killed after step 2
    printed = run(4, "--reuse")
    assert "resuming bf16 seed 1234" in printed
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4  # trained on from step 2, not restarted or skipped
    assert (run_dir / "compare_wall.json").is_file()
    assert "reusing" in run(4, "--reuse")  # now finished: reused as is



@pytest.mark.slow
def test_compare_reuse_checks_the_recorded_recipe(tmp_path_factory, capsys, monkeypatch):
    """--reuse keeps a finished run only when its recorded recipe (config.yaml) is the one this compare
    would run: a longer schedule resumes it to the new length, another setting starts it over, each with
    one line saying why; a run folder moved to another --out (and other thread counts) is still reused.
    summary.json records the run set, and compare-join refuses another recipe naming the key."""
    from fp4lightning.experiments.compare import join_summaries
    from fp4lightning.errors import UsageError

    corpus = prepared_test_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("compare-reuse-recipe")
    run_dir = out / "bf16" / "seed1234"

    def run(steps, *extra, where=out):
        args = ["compare", *tiny_overrides(corpus, where / "unused", f"schedule.max_steps={steps}",
                                           "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
                                           *extra),
                "--variants", "bf16", "--out", str(where), "--eval-tasks", "none", "--no-occ-report", "--reuse"]
        assert cli_main(args) == 0
        return capsys.readouterr().out

    def step():
        return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]

    run(2)
    short = json.loads((out / "summary.json").read_text())
    printed = run(4)  # the same recipe, twice the steps: continued from step 2, not reused as 2 steps
    assert "reusing" not in printed
    assert "resuming bf16 seed 1234: schedule.max_steps 2 -> 4" in printed and step() == 4
    long = json.loads((out / "summary.json").read_text())
    assert long["steps"] == 4 and long["variants"]["bf16"]["final_val_loss"] != short["variants"]["bf16"]["final_val_loss"]
    printed = run(4, "optimizer.weight_decay=0.0")  # another recipe: started over
    assert "training bf16 seed 1234: starting over (optimizer.weight_decay 0.1 -> 0.0)" in printed and step() == 4
    other = json.loads((out / "summary.json").read_text())
    printed = run(2, "optimizer.weight_decay=0.0")  # fewer steps cannot be had by resuming: started over
    assert "starting over (schedule.max_steps 4 -> 2)" in printed and step() == 2
    # the finished run's folder under another --out, with another thread count: reused as it is
    moved = tmp_path_factory.mktemp("compare-reuse-moved")
    (moved / "bf16").mkdir()
    shutil.copytree(run_dir, moved / "bf16" / "seed1234")
    printed = run(2, "optimizer.weight_decay=0.0", "trainer.num_threads=2", where=moved)
    assert "reusing" in printed and "bf16 seed 1234: reusing" in printed
    # summary.json records what defines the run set; compare-join compares it and names what differs
    assert long["run_set"]["optimizer.weight_decay"] == 0.1 and "seed" not in long["run_set"]
    assert not {"out_dir", "name", "data.dir", "trainer.num_threads"} & set(long["run_set"])
    (out / "long.json").write_text(json.dumps(long))
    (out / "other.json").write_text(json.dumps({**other, "variants": {"bf16": {**other["variants"]["bf16"],
                                                                              "seeds": [1235]}}}))
    with pytest.raises(UsageError, match=r"other\.json .*optimizer\.weight_decay: 0\.1 .* 0\.0"):
        join_summaries([out / "long.json", out / "other.json"])
    # the same recipe as a relative and as an absolute path joins; a summary without the record joins with a note
    monkeypatch.chdir(out)
    legacy = {k: v for k, v in long.items() if k != "run_set"}
    (out / "rel.json").write_text(json.dumps({**legacy, "recipe": "r.yaml"}))
    (out / "r.yaml").write_text("seed: 1234\n")
    (out / "abs.json").write_text(json.dumps({**long, "recipe": str(out / "r.yaml")}))
    joined, _ = join_summaries([out / "abs.json", out / "rel.json"])
    assert joined["variants"]["bf16"]["seeds"] == [1234]
    assert "rel.json has no run_set record" in capsys.readouterr().out


def test_zero_shot_table_in_percent():
    """Accuracies print in percent, as `fp4lightning eval`'s results.md; perplexities as they are."""
    from fp4lightning.experiments.compare import zero_shot_table

    table = zero_shot_table({"bf16": [{"fp4l_cloze": {"acc_norm": 0.125}, "fp4l_ppl": {"word_perplexity": 1988.0}}],
                             "fp4": [{"fp4l_cloze": {"acc_norm": 0.25}, "fp4l_ppl": {"word_perplexity": 1603.0}},
                                     {"fp4l_cloze": {"acc_norm": 0.35}, "fp4l_ppl": {"word_perplexity": 1605.0}}]})
    assert "| fp4l_cloze | acc_norm (%) | 12.50 | 30.00 ± 7.07 |" in table
    assert "| fp4l_ppl | word_perplexity | 1988 | 1604 ± 1.414 |" in table

def test_occ_report_on_model_activations():
    cfg = llama_config("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=2, ffn_dim=176, max_seq_len=32)
    model = Llama(cfg)
    acts = capture_linear_inputs(model, [torch.randint(0, 256, (2, 32))])
    assert len(acts) == 2 * 7 and "lm_head" not in acts  # head is not quantized
    rows = occ_fidelity_report(acts)
    snr = {r["variant"]: r["snr_db"] for r in rows}
    # compensation restores the clamped outliers exactly: it can only help, and a smaller
    # alpha compensates more of the tail
    assert snr["clamp + comp, alpha=0.999"] > snr["clamp only, alpha=0.999"]
    assert snr["clamp + comp, alpha=0.97"] > snr["clamp + comp, alpha=0.99"] > snr["clamp + comp, alpha=0.999"]
    assert all(0.5 < r["cosine"] <= 1.0 and r["mse"] > 0 for r in rows)


def test_compare_join_refuses_what_does_not_belong_together(tmp_path):
    """compare-join joins seeds of one recipe; other schedules, a variant at another rate, two different
    values for one seed and a missing or foreign file are refused with the file and the reason."""
    from fp4lightning.experiments.compare import join_summaries
    from fp4lightning.errors import UsageError

    def write(name, variants, steps=100):
        (tmp_path / name).write_text(json.dumps({"recipe": "r.yaml", "steps": steps, "tokens": steps * 10,
                                                 "variants": variants}))
        return tmp_path / name

    same = {"version": 1, "env": {"torch": "2.13.0+cpu"}, "parts": {"high": "h1"}}

    def v(preset, lr, seeds, vals, numerics=same):
        return {"preset": preset, "lr": lr, "seeds": seeds, "final_val_loss": vals, "mean": 0.0, "std": None,
                "numerics": [numerics] * len(seeds)}

    a = write("a.json", {"bf16": v("bf16", 2e-3, [1], [4.0]), "fp4": v("paper", 2e-3, [1], [3.8])})
    b = write("b.json", {"bf16": v("bf16", 2e-3, [2, 1], [4.2, 4.0]), "fp4": v("paper", 2e-3, [2], [3.9])})
    joined, table = join_summaries([a, b])
    assert joined["variants"]["bf16"]["seeds"] == [1, 2] and joined["variants"]["bf16"]["final_val_loss"] == [4.0, 4.2]
    assert joined["variants"]["fp4"]["val_gap_vs_reference"]["values"] == pytest.approx([3.8 / 4.0 - 1, 3.9 / 4.2 - 1])
    assert "| fp4 | 0.002 | 1, 2 |" in table
    cases = [
        ([a, write("c.json", {"bf16": v("bf16", 2e-3, [3], [4.1])}, steps=200)], r"c\.json is from another run set"),
        ([a, write("d.json", {"fp4": v("paper", 1e-3, [2], [3.9])})], r"'fp4' is preset paper at lr 0.001 in .*d\.json"),
        ([a, write("e.json", {"bf16": v("bf16", 2e-3, [1], [4.5])})], r"seed 1 of 'bf16' is 4.5 in .*e\.json"),
        ([a, tmp_path / "missing.json"], r"missing\.json does not exist"),
        ([a, write("f.json", {"something": 1})], r"f\.json is not a compare summary\.json"),
    ]
    for paths, match in cases:
        with pytest.raises(UsageError, match=match):
            join_summaries(paths)
    with pytest.raises(UsageError, match=r"--reference 'fp8'"):
        join_summaries([a], reference="fp8")
    # runs of other numerics (another machine's bf16 GeMMs) or with no fingerprint pair only when allowed
    other = {"version": 1, "env": {"torch": "2.13.0+cpu"}, "parts": {"high": "h2"}}
    g = write("g.json", {"bf16": v("bf16", 2e-3, [1], [4.0], other), "fp4": v("paper", 2e-3, [1], [3.8])})
    h = write("h.json", {"bf16": v("bf16", 2e-3, [1], [4.0], None), "fp4": v("paper", 2e-3, [1], [3.8])})
    for path, why in ((g, "the high path's numbers"), (h, "no numerics fingerprint recorded")):
        with pytest.raises(UsageError, match=rf"fp4 and bf16 seed 1 did not compute the same numbers \({why}"):
            join_summaries([path])
        _, table = join_summaries([path], allow_mixed_numerics=True)
        assert f"mixed (1 of 1 seeds: {why}" in table
    # a summary from before the -fp8 method variants meant fp8-fp16 states under the plain name
    old_all = {"preset": "fp4+all", "lr": 2e-3, "seeds": [1], "final_val_loss": [3.8], "mean": 3.8, "std": None}
    new_all = {**old_all, "overrides": ["trainer.precision=fp4", "fp4.preset=paper", "optimizer.states=fp16",
                                        "trainer.grad_comm=fp8-e4m3"], "seeds": [2], "final_val_loss": [3.9]}
    with pytest.raises(UsageError, match=r"'fp4\+all' trained with .*optimizer.states=fp16.* but with .*fp8-fp16"):
        join_summaries([write("i.json", {"fp4+all": old_all}), write("j.json", {"fp4+all": new_all})])
