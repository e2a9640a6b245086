"""lm-eval integration: the ``fp4lightning`` model, the offline tasks, ``fp4lightning eval``.

Fixtures are real and small: a corpus of real English (the Python language reference
topics shipped in every CPython as ``pydoc_data.topics``), prepared with the project's
tokenizer and shards, and tiny LLaMAs trained a few steps with Lightning's Trainer (one in
BF16 mixed precision, one in FP4). Everything runs offline (conftest sets the HF switches).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp4lightning.data import prepare
from fp4lightning.eval.tasks import OFFLINE_TASKS, build_offline_tasks, heldout_documents, offline_tasks_dir

# float32 CPU forward passes of the same tokens in different batch shapes agree to ~1e-5
# relative; HF's LlamaForCausalLM on the exported weights agrees bitwise here (measured)
LOGLIK_RTOL = 1e-4
LOGLIK_ATOL = 1e-3
# FP4 (linear=fp4) scores depend on the batch through OCC's tensor-wide quantiles. Measured on
# the tiny model: batched vs unbatched FP4 <= 0.22% (<= 0.2 nats), FP4 vs the same weights in
# high precision <= 0.2% (<= 0.25 nats); thresholds ~10x and 2x above
FP4_RTOL = 0.02
FP4_ATOL = 0.5

TINY_MODEL = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, ffn_dim=176, max_seq_len=128)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("evaldata")
    src = root / "src"
    src.mkdir()
    for name, text in topics.items():
        (src / f"{name}.txt").write_text(text, encoding="utf-8")
    return prepare(str(src), root / "data", vocab_size=512, val_fraction=0.2)


def _train(data_dir: Path, out: Path, steps: int, fp4: dict | None, tokenizer: bool = True) -> Path:
    import lightning as L

    from fp4lightning.data import TokenDataModule
    from fp4lightning.train.module import LlamaLightningModule
    from fp4lightning.train.recipe import fp4_config_from_spec, load_recipe, recipe_to_dict

    dm = TokenDataModule(data_dir, seq_len=64, micro_batch_size=8, train_batches=steps, val_batches=1)
    recipe = load_recipe(None, [f"data.dir={data_dir}", f"trainer.precision={'fp4' if fp4 else 'bf16-mixed'}"])
    module = LlamaLightningModule(
        model=TINY_MODEL, lr=3e-3, max_steps=steps, fp4=fp4,
        fp4_config=fp4_config_from_spec(fp4) if fp4 else None, recipe=recipe_to_dict(recipe),
        tokenizer_json=dm.tokenizer.to_str() if tokenizer else None,
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, precision="32-true" if fp4 else "bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out,
    )
    trainer.fit(module, datamodule=dm)
    path = out / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def bf16_ckpt(data_dir, tmp_path_factory) -> Path:
    return _train(data_dir, tmp_path_factory.mktemp("bf16"), steps=8, fp4=None)


@pytest.fixture(scope="module")
def fp4_ckpt(data_dir, tmp_path_factory) -> Path:
    return _train(data_dir, tmp_path_factory.mktemp("fp4"), steps=2, fp4={"preset": "paper"})


@pytest.fixture(scope="module")
def tasks_dir(data_dir) -> Path:
    return build_offline_tasks(data_dir)


def _lm(ckpt, **kw):
    from fp4lightning.eval.lm import FP4LightningLM

    return FP4LightningLM(pretrained=str(ckpt), device="cpu", **kw)


def _instances(kind: str, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def _requests(tasks_dir: Path, n: int = 12) -> list[tuple[str, str]]:
    """(context, continuation) pairs from the offline tasks: last words and cloze endings."""
    reqs = []
    for line in (tasks_dir / "fp4l_lastword.jsonl").read_text().splitlines()[:n]:
        text = json.loads(line)["text"]
        ctx, _, word = text.rpartition(" ")
        reqs.append((ctx, " " + word))
    for line in (tasks_dir / "fp4l_cloze.jsonl").read_text().splitlines()[: n // 3]:
        item = json.loads(line)
        reqs.extend((item["context"], " " + c) for c in item["choices"])
    reqs.append(("", "An empty context is conditioned on BOS."))
    reqs.append(("Trailing spaces move to the continuation ", "here"))
    return reqs


# ----------------------------------------------------------------------------- offline tasks
def test_offline_tasks_from_heldout_text(data_dir, tasks_dir, monkeypatch):
    from pydoc_data.topics import topics

    import fp4lightning.eval.tasks as eval_tasks

    assert tasks_dir == offline_tasks_dir(data_dir)
    manifest = json.loads((tasks_dir / "manifest.json").read_text())
    assert all(manifest["tasks"][t] > 10 for t in OFFLINE_TASKS), manifest
    # held-out documents decode back to the source text exactly (BOS ... EOS, byte-level BPE)
    sources = [t.replace("\r\n", "\n") for t in topics.values()]
    docs = list(heldout_documents(data_dir))
    assert docs and all(any(d in s for s in sources) for d in docs)
    monkeypatch.setattr(eval_tasks, "_SCAN_TOKENS", 999)  # documents straddling read chunks
    assert list(heldout_documents(data_dir)) == docs
    for name in OFFLINE_TASKS:
        cfg = (tasks_dir / f"{name}.yaml").read_text()
        data_file = Path(cfg.split("test: ", 1)[1].split("\n", 1)[0])
        assert data_file.is_absolute() and data_file.is_file(), cfg
    flat = [" ".join(d.split()) for d in docs]
    for line in (tasks_dir / "fp4l_lastword.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert item["text"].endswith(" " + item["target"])
        assert re.fullmatch(r"[A-Za-z][A-Za-z'\-]*[A-Za-z]", item["target"]), item
        assert any(item["text"] in f for f in flat)  # a real passage, cut at a sentence's last word
    for line in (tasks_dir / "fp4l_cloze.jsonl").read_text().splitlines():
        item = json.loads(line)
        gold = item["choices"][item["label"]]
        assert len(set(item["choices"])) == 4
        assert any(item["context"] + " " + gold in f for f in flat)  # the true next sentence
    # idempotent; rebuilt when forced
    before = (tasks_dir / "manifest.json").stat().st_mtime_ns
    assert build_offline_tasks(data_dir) == tasks_dir
    assert (tasks_dir / "manifest.json").stat().st_mtime_ns == before


def test_offline_tasks_need_prepared_data(tmp_path):
    from fp4lightning.data import DataNotPreparedError

    with pytest.raises(DataNotPreparedError, match="fp4lightning data prepare"):
        build_offline_tasks(tmp_path)


# ----------------------------------------------------------------------------- scoring
@pytest.mark.slow
def test_batched_and_unbatched_loglikelihoods_agree(bf16_ckpt, tasks_dir):
    reqs = _instances("loglikelihood", _requests(tasks_dir))
    one = _lm(bf16_ckpt, batch_size=1, logits_cache=False).loglikelihood(reqs, disable_tqdm=True)
    many = _lm(bf16_ckpt, batch_size=7).loglikelihood(reqs, disable_tqdm=True)
    a = torch.tensor([x for x, _ in one], dtype=torch.float64)
    b = torch.tensor([x for x, _ in many], dtype=torch.float64)
    assert torch.all(a < 0)
    torch.testing.assert_close(b, a, rtol=LOGLIK_RTOL, atol=LOGLIK_ATOL)
    assert [g for _, g in one] == [g for _, g in many]


def test_loglikelihood_is_the_model_logprob_at_the_token_split(bf16_ckpt):
    """Context/continuation split at token boundaries, as lm-eval's hf model does."""
    lm = _lm(bf16_ckpt, batch_size=4)
    ctx, cont = "The assert statement is a convenient way ", "to insert debugging assertions"
    (ll, greedy), = lm.loglikelihood(_instances("loglikelihood", [(ctx, cont)]), disable_tqdm=True)
    tok = lm.tokenizer
    whole = tok.encode(ctx.rstrip(" ") + " " + cont)  # the trailing space joins the continuation
    n_ctx = len(tok.encode(ctx.rstrip(" ")))
    with torch.no_grad():
        logp = F.log_softmax(lm.model(torch.tensor([whole[:-1]])).float(), -1)[0]
    targets = torch.tensor(whole[n_ctx:])
    ref = logp[n_ctx - 1 :].gather(1, targets[:, None]).sum().item()
    assert whole[0] == tok.bos_id
    assert ll == pytest.approx(ref, rel=LOGLIK_RTOL, abs=LOGLIK_ATOL)
    assert greedy == bool((logp[n_ctx - 1 :].argmax(-1) == targets).all())


def _direct_rolling_logprob(model, bos: int, toks: list[int], window: int) -> float:
    """Sum log p(token) where each block of ``window`` tokens sees the most context that fits.

    Block k predicts tokens [k*window, min((k+1)*window, N)) from the ``window`` tokens of
    ``[BOS] + toks`` that end right before its last target (lm-eval's rolling windows).
    """
    seq = [bos] + toks
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(toks), window):
            end = min(start + window, len(toks))
            lo = max(0, end - window)
            inp = torch.tensor([seq[lo:end]])
            logp = F.log_softmax(model(inp).float(), -1)[0]  # position p predicts seq[lo + p + 1]
            for j in range(start, end):
                total += logp[j - lo, toks[j]].item()
    return total


@pytest.mark.slow
def test_rolling_perplexity_matches_direct_computation(bf16_ckpt, data_dir):
    doc = next(heldout_documents(data_dir))
    short = doc[:200]
    lm = _lm(bf16_ckpt, batch_size=4)
    toks_short = lm.tokenizer.encode(short, bos=False)
    assert len(toks_short) < lm.max_length
    with torch.no_grad():  # one window: the plain next-token loss over [BOS] + text
        seq = torch.tensor([[lm.tokenizer.bos_id] + toks_short])
        nll = F.cross_entropy(lm.model(seq[:, :-1]).float()[0], seq[0, 1:], reduction="sum").item()
    # a long document needs many windows: check them against an independent loop
    lm_small = _lm(bf16_ckpt, batch_size=5, max_length=32)
    toks_long = lm.tokenizer.encode(doc, bos=False)[:300]
    long_text = lm.tokenizer.decode(toks_long)
    assert lm.tokenizer.encode(long_text, bos=False) == toks_long
    got = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(short,)]), disable_tqdm=True)
    got_long = lm_small.loglikelihood_rolling(_instances("loglikelihood_rolling", [(long_text,)]), disable_tqdm=True)
    assert got[0] == pytest.approx(-nll, rel=LOGLIK_RTOL)
    ref_long = _direct_rolling_logprob(lm_small.model, lm.tokenizer.bos_id, toks_long, 32)
    assert got_long[0] == pytest.approx(ref_long, rel=LOGLIK_RTOL)
    assert math.exp(-got[0] / len(toks_short)) > 1.0


def test_generate_until_is_greedy_and_stops(bf16_ckpt):
    lm = _lm(bf16_ckpt, batch_size=2)
    prompt = "The return statement"
    ids = lm.tok_encode(prompt)
    ref = []
    with torch.no_grad():  # greedy decoding by hand
        for _ in range(12):
            logits = lm.model(torch.tensor([ids + ref])).float()[0, -1, : lm.tokenizer.vocab_size]
            ref.append(int(logits.argmax()))
            if ref[-1] == lm.tokenizer.eos_id:
                break
    free = lm.tokenizer.decode(ref)
    reqs = [(prompt, {"until": ["\u0000never"], "max_gen_toks": 12}), ("Other, longer prompt here", {"until": ["\u0000never"], "max_gen_toks": 12})]
    out = lm.generate_until(_instances("generate_until", reqs), disable_tqdm=True)
    assert out[0] == free
    stop = free.strip()[:2] if free.strip() else None
    if stop:  # a stop string cuts the text where it first appears
        cut = lm.generate_until(_instances("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})]),
                                disable_tqdm=True)
        assert cut[0] == free.split(stop)[0]


# ----------------------------------------------------------------------------- FP4 / high precision
@pytest.mark.slow
def test_linear_modes(fp4_ckpt, bf16_ckpt, tasks_dir):
    from fp4lightning.train.checkpoint import load_checkpoint
    from fp4lightning.nn.linear import FP4Linear

    reqs = _instances("loglikelihood", _requests(tasks_dir, n=3))  # FP4 on CPU is slow: 7 requests
    fp4 = _lm(fp4_ckpt, batch_size=1, logits_cache=False)
    assert fp4.linear == "fp4" and fp4.trained_fp4
    assert any(isinstance(m, FP4Linear) for m in fp4.model.modules())
    high = _lm(fp4_ckpt, batch_size=4, linear="high")
    assert high.linear == "high" and not any(isinstance(m, FP4Linear) for m in high.model.modules())
    plain = load_checkpoint(fp4_ckpt).model  # the master weights as a plain high-precision Llama
    for k, v in plain.state_dict().items():
        assert torch.equal(high.model.state_dict()[k], v), k
    ll_fp4 = torch.tensor([x for x, _ in fp4.loglikelihood(reqs, disable_tqdm=True)])
    ll_high = torch.tensor([x for x, _ in high.loglikelihood(reqs, disable_tqdm=True)])
    assert not torch.allclose(ll_fp4, ll_high, rtol=1e-4)  # the FP4 GeMMs really ran
    torch.testing.assert_close(ll_fp4, ll_high, rtol=FP4_RTOL, atol=FP4_ATOL)
    fp4_batched = _lm(fp4_ckpt, batch_size=8)
    ll_fp4_b = torch.tensor([x for x, _ in fp4_batched.loglikelihood(reqs, disable_tqdm=True)])
    torch.testing.assert_close(ll_fp4_b, ll_fp4, rtol=FP4_RTOL, atol=FP4_ATOL)
    # a BF16 run scored with FP4 GeMMs (paper recipe)
    bf16_as_fp4 = _lm(bf16_ckpt, linear="fp4")
    assert bf16_as_fp4.linear == "fp4" and not bf16_as_fp4.trained_fp4
    assert bf16_as_fp4.fp4_config["occ"] and bf16_as_fp4.fp4_config["skip_modules"]


# ----------------------------------------------------------------------------- lm-eval end to end
@pytest.mark.slow
def test_simple_evaluate_runs_offline_tasks(bf16_ckpt, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import fp4lightning.eval.lm  # noqa: F401  (registers "fp4lightning")

    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    res = lm_eval.simple_evaluate(
        model="fp4lightning", model_args={"pretrained": str(bf16_ckpt), "batch_size": 8, "device": "cpu"},
        tasks=["fp4l_offline"], limit=4, bootstrap_iters=0, task_manager=tm, log_samples=True,
    )
    r = res["results"]
    assert set(OFFLINE_TASKS) <= set(r)
    assert 0.0 <= r["fp4l_lastword"]["acc,none"] <= 1.0 and r["fp4l_lastword"]["perplexity,none"] > 1.0
    assert 0.0 <= r["fp4l_cloze"]["acc,none"] <= 1.0 and 0.0 <= r["fp4l_cloze"]["acc_norm,none"] <= 1.0
    bpb = r["fp4l_ppl"]["bits_per_byte,none"]
    # bits per byte recomputed from the logged per-document log-likelihoods
    samples = res["samples"]["fp4l_ppl"]
    ll = sum(s["resps"][0][0] for s in samples)
    nbytes = sum(len(s["doc"]["text"].encode("utf-8")) for s in samples)
    assert bpb == pytest.approx(-ll / nbytes / math.log(2), rel=1e-6)
    assert 0.5 < bpb < 9.0  # a real (if undertrained) model: well under the 9 bits of a uniform byte


@pytest.mark.slow
def test_eval_command_and_compare(bf16_ckpt, fp4_ckpt, tasks_dir, data_dir, tmp_path, capsys):
    from fp4lightning.cli import main

    out_a, out_b, out_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # FP4 GeMMs on CPU are slow (reference kernels): one batch of two passages
    assert main(["eval", str(fp4_ckpt), "--tasks", "fp4l_lastword", "--limit", "2", "--batch-size", "8",
                 "--out", str(out_a)]) == 0
    # no --data-dir: the run's recipe names its data directory
    assert main(["eval", str(bf16_ckpt), "--tasks", "fp4l_lastword,fp4l_cloze", "--limit", "2", "--batch-size", "8",
                 "--out", str(out_b)]) == 0
    res_a = json.loads((out_a / "results.json").read_text())
    assert res_a["fp4lightning"]["linear"] == "fp4" and res_a["fp4lightning"]["data_dir"] == str(data_dir.resolve())
    assert "| fp4l_cloze | acc_norm |" in (out_b / "results.md").read_text()
    capsys.readouterr()
    assert main(["eval", "--compare", str(out_a / "results.json"), str(out_b / "results.json"), "--out", str(out_c)]) == 0
    printed = capsys.readouterr().out
    table = (out_c / "compare.md").read_text()
    # the offline tasks measure unrelated things: no average row
    assert "| Task | Metric | FP4 | BF16 | FP4 - BF16 |" in table and "Average" not in table
    a_ppl = res_a["results"]["fp4l_lastword"]["perplexity,none"]
    assert f"| fp4l_lastword | perplexity | {a_ppl:.2f} |" in table or f"{a_ppl:.3g}" in table
    assert "| fp4l_cloze | acc |" in table and table.strip() in printed


def test_averages_never_mix_perplexity_units():
    """lambada's ``perplexity`` (per target word) and wikitext's ``word_perplexity`` are different
    units: each metric is averaged only over the tasks that report that same metric."""
    from fp4lightning.eval.run import compare_table, results_table

    a = {"lambada_openai": {"acc": 0.5, "perplexity": 10.0}, "lambada_standard": {"acc": 0.3, "perplexity": 30.0},
         "wikitext": {"word_perplexity": 100.0, "bits_per_byte": 1.0},
         "pile_10k": {"word_perplexity": 300.0, "bits_per_byte": 1.5}}
    b = {t: {m: 2 * v for m, v in ms.items()} for t, ms in a.items()}
    table = results_table(a)
    assert "| **Average** (paper-ppl, 2 tasks) | perplexity | 20.00 |" in table
    assert "| **Average** (paper-ppl, 2 tasks) | word_perplexity | 200.00 |" in table
    assert "110.00" not in table  # the mean of all four perplexities, which mixes the units
    # lambada_standard is no zero-shot task of the paper: one zero-shot acc here, so no acc average
    assert "| acc | 40.00 |" not in table
    side = compare_table(a, b, "FP4", "BF16")
    assert "| **Average** (paper-ppl, 2 tasks) | perplexity | 20.00 | 40.00 | -20.00 |" in side
    assert "| **Average** (paper-ppl, 2 tasks) | word_perplexity | 200.00 | 400.00 | -200.00 |" in side
    assert "| acc | 40.00 | 80.00 |" not in side
    assert "bits_per_byte | 1.2500" not in table + side  # bits per byte is reported, never averaged


# ----------------------------------------------------------------------------- Hugging Face parity
@pytest.mark.slow
def test_matches_lm_eval_hf_model_on_exported_checkpoint(bf16_ckpt, tasks_dir, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="lm-eval's hf model imports accelerate (the [hf] extra)")
    from lm_eval.models.huggingface import HFLM

    from fp4lightning.train.checkpoint import load_checkpoint
    from fp4lightning.models.hf import save_hf

    model, tok, _ = load_checkpoint(bf16_ckpt)
    export = save_hf(model, tmp_path / "hf", tok)
    reqs = _instances("loglikelihood", _requests(tasks_dir, n=9))
    ours = _lm(bf16_ckpt, batch_size=4).loglikelihood(reqs, disable_tqdm=True)
    # our contexts start with BOS as training documents did; the exported tokenizer adds it by
    # default, so lm-eval's hf model with no extra flags scores every choice the same
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(export)("The assert statement").input_ids[0] == tok.bos_id
    hf = HFLM(pretrained=str(export), batch_size=3, device="cpu", dtype="float32")
    theirs = hf.loglikelihood(reqs, disable_tqdm=True)
    torch.testing.assert_close(torch.tensor([x for x, _ in ours], dtype=torch.float64),
                               torch.tensor([x for x, _ in theirs], dtype=torch.float64),
                               rtol=LOGLIK_RTOL, atol=1e-4)
    assert [g for _, g in ours] == [g for _, g in theirs]
    # rolling: hf prefixes BOS itself, so it matches with add_bos_token=False (docs/evaluation.md)
    hf_plain = HFLM(pretrained=str(export), batch_size=3, device="cpu", dtype="float32", add_bos_token=False)
    doc = (tasks_dir / "fp4l_ppl.jsonl").read_text().splitlines()[0]
    rreqs = _instances("loglikelihood_rolling", [(json.loads(doc)["text"][:3000],)])
    torch.testing.assert_close(
        torch.tensor(_lm(bf16_ckpt, batch_size=4).loglikelihood_rolling(rreqs, disable_tqdm=True)),
        torch.tensor(hf_plain.loglikelihood_rolling(rreqs, disable_tqdm=True)), rtol=LOGLIK_RTOL, atol=1e-3)
    gen = _instances("generate_until", [("The assert statement", {"until": ["."], "max_gen_toks": 16})])
    assert _lm(bf16_ckpt).generate_until(gen, disable_tqdm=True) == hf.generate_until(gen, disable_tqdm=True)


# ----------------------------------------------------------------------------- errors
def test_missing_checkpoint_or_tokenizer_is_a_clear_error(bf16_ckpt, data_dir, tmp_path):
    from fp4lightning.eval.lm import FP4LightningLM

    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nope\.ckpt not found.*fp4lightning train"):
        FP4LightningLM(pretrained=str(tmp_path / "nope.ckpt"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*missing\.json not found"):
        FP4LightningLM(pretrained=str(bf16_ckpt), tokenizer=str(tmp_path / "missing.json"))
    # a checkpoint without an embedded tokenizer and none beside it
    ckpt = torch.load(bf16_ckpt, map_location="cpu", weights_only=True)
    ckpt["tokenizer"] = None
    (tmp_path / "run").mkdir()
    bare = tmp_path / "run" / "bare.ckpt"
    torch.save(ckpt, bare)
    with pytest.raises(FileNotFoundError, match="carries no tokenizer.*tokenizer=<data_dir>/tokenizer.json"):
        FP4LightningLM(pretrained=str(bare))
    lm = FP4LightningLM(pretrained=str(bare), tokenizer=str(data_dir))  # a data dir holding tokenizer.json works
    assert lm.tokenizer.vocab_size == 512
    with pytest.raises(ValueError, match="linear='fp8' is not one of"):
        FP4LightningLM(pretrained=str(bf16_ckpt), linear="fp8")


def test_hub_tasks_fail_fast_offline(bf16_ckpt, capsys):
    from fp4lightning.cli import main
    from fp4lightning.eval.run import HubUnavailableError, evaluate_checkpoint, resolve_tasks

    assert resolve_tasks("paper-ppl") == ["lambada_openai", "lambada_standard", "wikitext", "pile_10k"]
    assert resolve_tasks("offline,paper")[:3] == list(OFFLINE_TASKS) and len(resolve_tasks("paper")) == 9
    t0 = time.perf_counter()
    with pytest.raises(HubUnavailableError, match=r"(?s)hub is unreachable.*piqa.*--tasks offline"):
        evaluate_checkpoint(bf16_ckpt, "paper", verbose=False)
    assert time.perf_counter() - t0 < 30  # no network retries
    assert main(["eval", str(bf16_ckpt), "--tasks", "wikitext"]) == 2
    assert "--tasks offline" in capsys.readouterr().err


# ----------------------------------------------------------------------------- lm-eval's CLI, user tasks, auto batch
def _user_task_dir(tasks_dir: Path, root: Path) -> Path:
    """A folder holding the user's own task YAML (a renamed copy of ``fp4l_cloze``)."""
    import yaml

    cfg = yaml.safe_load((tasks_dir / "fp4l_cloze.yaml").read_text())
    cfg["task"] = "my_cloze"
    cfg.pop("tag", None)
    d = root / "my_tasks"
    d.mkdir()
    (d / "my_cloze.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return d


def _run_cli(args: list[str], cwd: Path, timeout: float = 240) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_lm_eval_console_script_finds_the_model(bf16_ckpt, tasks_dir, tmp_path):
    """``fp4lightning-lm-eval`` (installed console script) is lm-eval's CLI with our model registered."""
    from importlib.metadata import entry_points

    eps = entry_points(group="console_scripts", name="fp4lightning-lm-eval")
    assert len(eps) == 1, "fp4lightning-lm-eval is not installed: pip install -e . again"
    ep = next(iter(eps))
    user = _user_task_dir(tasks_dir, tmp_path)
    # exactly what the installed script does: load the entry point and call it
    code = (f"import sys; from importlib.metadata import entry_points; "
            f"sys.argv=['fp4lightning-lm-eval', *sys.argv[1:]]; "
            f"sys.exit(next(iter(entry_points(group='console_scripts', name={ep.name!r}))).load()())")
    proc = _run_cli([code, "run", "--model", "fp4lightning", "--model_args",
                     f"pretrained={bf16_ckpt},linear=high", "--batch_size", "auto", "--tasks", "my_cloze",
                     "--include_path", str(user), "--limit", "2", "--output_path", str(tmp_path / "out")],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no device asked for on a machine without CUDA: the CPU, without a word about cuda:0 (lm-eval's
    # default); tmp_path is no git checkout: no "fatal: not a git repository" from lm-eval's git lookup
    if not torch.cuda.is_available():
        assert "CUDA is not available" not in proc.stderr and "cuda:0" not in proc.stderr, proc.stderr[-3000:]
    assert "not a git repository" not in proc.stderr, proc.stderr[-3000:]
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert len(files) == 1, proc.stderr[-2000:]
    res = json.loads(files[0].read_text())
    assert "acc_norm,none" in res["results"]["my_cloze"] and res["config"]["linear"] == "high"


@pytest.mark.slow
def test_eval_command_include_path_and_auto_batch(bf16_ckpt, tasks_dir, tmp_path):
    """``fp4lightning eval --include_path DIR --batch-size auto``, through the CLI's own parser."""
    from fp4lightning.cli import main as cli_main

    user = _user_task_dir(tasks_dir, tmp_path)
    out = tmp_path / "res"
    assert cli_main(["eval", str(bf16_ckpt), "--tasks", "my_cloze", "--include_path", str(user),
                     "--batch-size", "auto", "--limit", "2", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["results"]) == {"my_cloze"} and "acc_norm,none" in res["results"]["my_cloze"]
    assert res["fp4lightning"]["batch_size"] >= 1 and res["fp4lightning"]["include_path"] == [str(user)]


def test_auto_batch_size_scores_like_a_fixed_one(bf16_ckpt, tasks_dir):
    lm = _lm(bf16_ckpt, batch_size="auto", max_batch_size=16)
    assert lm.batch_size == 16  # a 2-layer model at 128 tokens fits 16 sequences on any CPU
    reqs = _instances("loglikelihood", _requests(tasks_dir, n=3))
    a = lm.loglikelihood(reqs, disable_tqdm=True)
    b = _lm(bf16_ckpt, batch_size=1).loglikelihood(reqs, disable_tqdm=True)
    torch.testing.assert_close(torch.tensor([x for x, _ in a]), torch.tensor([x for x, _ in b]),
                               rtol=LOGLIK_RTOL, atol=LOGLIK_ATOL)
    with pytest.raises(ValueError, match="batch_size must be an integer or auto"):
        _lm(bf16_ckpt, batch_size="big")
