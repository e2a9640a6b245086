"""Serve a trained checkpoint with llama.cpp (llama-cpp-python) on CPU and hold it against our own forward.

    python scripts/serve_llama_cpp.py CKPT [--out DIR] [--install] [--windows N] [--threads T]

1. ``--install``: ``pip install llama-cpp-python==0.3.36`` into this Python (an sdist: cmake builds
   llama.cpp, several minutes on 2 cores; ``CMAKE_ARGS=-DGGML_NATIVE=ON``), unless it imports already.
2. Exports CKPT twice with ``fp4lightning export-gguf``'s writer: ``fp4.gguf``, its FP4 layers as the codes
   and scales training used (MXFP4 or NVFP4, the rest F16), and ``f16.gguf``, every weight F16 (the FP4
   layers' master weights): the same model in high precision.
3. Scores the same windows of the held-out validation tokens (the data folder the run trained on,
   ``val-*.bin``) with llama.cpp (both files) and with ours: the master weights in fp32, the FP4 weights
   with fp32 activations (what the FP4 GGUF holds), and the training forward (FP4 activations too).
   llama.cpp rounds the activations of every MXFP4 / NVFP4 dot product to Q8_0 (int8, one fp16 scale per
   32 values) and those of F16 ones to fp16, and keeps its KV cache in F16, so its perplexity sits a little
   off ours with the same weights: the script prints that gap.
4. Generates greedily from ``--prompt`` with each file and times llama.cpp: prompt processing (one window
   per call) and generation (one token per call), tokens/s, each the median over its calls.

Prints a table and writes ``DIR/serve.json``. Token ids go to llama.cpp as ids (``Llama.eval``), so the
scores do not depend on its tokenizer; the prompt goes through the GGUF's tokenizer, and the script checks
it gives our tokenizer's ids.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LLAMA_CPP = "llama-cpp-python==0.3.36"
#: llama.cpp for this CPU, without what the Python package does not use (tools, tests, the multimodal library)
CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF")
ROOT = Path(__file__).resolve().parents[1]


def install(threads: int) -> None:
    """``pip install`` llama-cpp-python (built from source for this CPU) unless it imports."""
    try:
        import llama_cpp  # noqa: F401
        return
    except ImportError:
        pass
    env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", CMAKE_ARGS), CMAKE_BUILD_PARALLEL_LEVEL=str(threads))
    print(f"installing {LLAMA_CPP} (builds llama.cpp with cmake: minutes) ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", "-c", str(ROOT / "constraints.txt"), LLAMA_CPP],
                   check=True, env=env)
    print(f"installed in {time.perf_counter() - t0:.0f} s", flush=True)


def export(ckpt: str, out: Path) -> dict:
    """Write ``fp4.gguf`` and ``f16.gguf`` of ``ckpt``; returns what each holds."""
    from fp4lightning.models.gguf_export import export_gguf
    from fp4lightning.train.checkpoint import load_checkpoint

    fp4_model, tok, recipe = load_checkpoint(ckpt, fp4=True)
    plain, _, _ = load_checkpoint(ckpt)
    name = recipe.name if recipe is not None else None
    r_fp4 = export_gguf(fp4_model, tok, out / "fp4.gguf", "f16", overwrite=True, name=name)
    r_f16 = export_gguf(plain, tok, out / "f16.gguf", "f16", overwrite=True, name=name)
    return {"fp4.gguf": r_fp4.summary(), "f16.gguf": r_f16.summary()}


def val_windows(data_dir: Path, n: int, length: int) -> np.ndarray:
    """``n`` windows of ``length`` tokens spread evenly over the validation split (int64 (n, length))."""
    meta = json.loads((data_dir / "meta.json").read_text())
    shards = [np.memmap(data_dir / s["file"], dtype=meta["dtype"], mode="r") for s in meta["splits"]["val"]["shards"]]
    tokens = np.concatenate(shards)
    n = min(n, len(tokens) // length)
    starts = np.linspace(0, len(tokens) - length, n).astype(np.int64)
    return np.stack([tokens[s: s + length] for s in starts]).astype(np.int64)


def _nll(logits: np.ndarray, window: np.ndarray) -> tuple[float, int]:
    """Sum of -log p(next token) over a window from its (length, vocab) logits, in float64."""
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    return float((lse - lg[np.arange(len(lg)), window[1:]]).sum()), len(lg)


def ours(ckpt: str, windows: np.ndarray) -> dict:
    """Perplexity of our model on ``windows``: master weights, FP4 weights with fp32 activations, training
    forward (fp32 activations quantized as in training)."""
    import torch

    from fp4lightning.models.ct_export import forward_weight
    from fp4lightning.nn.linear import FP4Linear
    from fp4lightning.train.checkpoint import load_checkpoint

    fp4_model, _, _ = load_checkpoint(ckpt, fp4=True)
    master, _, _ = load_checkpoint(ckpt)
    fp4_weights, _, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        for name, mod in fp4_model.named_modules():
            if isinstance(mod, FP4Linear):
                fp4_weights.get_submodule(name).weight.copy_(forward_weight(mod))
    out = {}
    for label, model in (("ours: master weights, fp32", master), ("ours: FP4 weights, fp32 activations", fp4_weights),
                         ("ours: training forward (FP4 weights and activations)", fp4_model)):
        total, count = 0.0, 0
        with torch.no_grad():
            for w in windows:
                logits = model(torch.from_numpy(w)[None]).float()[0].numpy()
                s, c = _nll(logits, w)
                total, count = total + s, count + c
        out[label] = math.exp(total / count)
    return out


def engine(path: Path, windows: np.ndarray, threads: int, prompt: str, gen_tokens: int) -> dict:
    """llama.cpp on one GGUF file: perplexity on ``windows``; prompt speed (one window per call) and generation
    speed (one token per call, three greedy runs), each the median over its calls, in tokens/s; a completion."""
    from llama_cpp import Llama

    length = windows.shape[1]
    llm = Llama(str(path), n_ctx=length, n_batch=length, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    total, count, prompt_s = 0.0, 0, []
    for w in windows:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(w.tolist())
        prompt_s.append(time.perf_counter() - t0)
        s, c = _nll(np.asarray(llm.scores[:length]), w)
        total, count = total + s, count + c
    prompt_ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)[: length // 2]
    gen_tokens = min(gen_tokens, length - len(prompt_ids))
    token_s = []
    for _ in range(3):
        llm.reset()
        llm.eval(prompt_ids)
        ids = []
        for _ in range(gen_tokens):
            ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            t0 = time.perf_counter()
            llm.eval([ids[-1]])
            token_s.append(time.perf_counter() - t0)
    return {"perplexity": math.exp(total / count), "prompt_tok_s": length / float(np.median(prompt_s)),
            "gen_tok_s": 1 / float(np.median(token_s)), "prompt_ids": prompt_ids, "completion_ids": ids}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a training checkpoint (.ckpt or run folder)")
    p.add_argument("--out", default="runs/serve", help="folder for the GGUF files and serve.json")
    p.add_argument("--data", default=None, help="data folder with val-*.bin (default: the run's data.dir)")
    p.add_argument("--windows", type=int, default=16, help="validation windows scored (default 16)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens generated for the speed test (default 64)")
    p.add_argument("--prompt", default="The king said", help="prompt of the greedy completion")
    p.add_argument("--install", action="store_true", help=f"pip install {LLAMA_CPP} first if it does not import")
    p.add_argument("--speed-shape", default=None, metavar="DIM,LAYERS,FFN",
                   help="also time llama.cpp on a model of this shape (random weights, the run's FP4 recipe and "
                        "vocabulary): tokens/s of the FP4 and the F16 file at a width closer to real models")
    args = p.parse_args(argv)
    if args.install:
        install(os.cpu_count() or 1)
    import torch

    torch.set_num_threads(args.threads)
    from fp4lightning.train.checkpoint import load_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok, recipe = load_checkpoint(args.ckpt)
    if args.data is None and recipe is None:
        raise SystemExit("the checkpoint records no recipe: name the data folder with --data")
    data = Path(args.data or recipe.data.dir)
    length = recipe.data.seq_len if recipe is not None else model.config.max_seq_len
    windows = val_windows(data, args.windows, length)
    result = {"ckpt": str(args.ckpt), "windows": list(windows.shape), "threads": args.threads,
              "files": export(args.ckpt, out), "ours": ours(args.ckpt, windows), "llama.cpp": {}}
    for name in ("fp4.gguf", "f16.gguf"):
        r = engine(out / name, windows, args.threads, args.prompt, args.gen_tokens)
        r["prompt_ids_match_ours"] = r.pop("prompt_ids") == tok.encode(args.prompt)
        r["completion"] = tok.decode(r.pop("completion_ids"))
        result["llama.cpp"][name] = r
    if args.speed_shape:
        result["speed"] = speed(args.ckpt, [int(x) for x in args.speed_shape.split(",")], out, windows, args)
    (out / "serve.json").write_text(json.dumps(result, indent=2))
    _print(result)
    return 0


def speed(ckpt: str, shape: list[int], out: Path, windows: np.ndarray, args) -> dict:
    """llama.cpp's tokens/s on a random model of ``shape`` (dim, layers, ffn; 64-dim heads), FP4 as the run's
    layers and F16; perplexities of random weights mean nothing and are not reported."""
    import dataclasses

    import torch

    from fp4lightning.models.gguf_export import export_gguf
    from fp4lightning.models.llama import Llama
    from fp4lightning.nn.convert import convert_to_fp4
    from fp4lightning.nn.linear import FP4Linear
    from fp4lightning.train.checkpoint import load_checkpoint

    fp4_model, tok, _ = load_checkpoint(ckpt, fp4=True)
    fp4_cfg = next(m.config for m in fp4_model.modules() if isinstance(m, FP4Linear))
    dim, layers, ffn = shape
    cfg = dataclasses.replace(fp4_model.config, dim=dim, n_layers=layers, ffn_dim=ffn, n_heads=dim // 64,
                              n_kv_heads=None)
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    export_gguf(model, tok, out / "speed-f16.gguf", "f16", overwrite=True)
    export_gguf(convert_to_fp4(model, fp4_cfg), tok, out / "speed-fp4.gguf", "f16", overwrite=True)
    res = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters())}
    for name in ("speed-fp4.gguf", "speed-f16.gguf"):
        r = engine(out / name, windows[:4], args.threads, args.prompt, args.gen_tokens)
        res[name] = {"prompt_tok_s": r["prompt_tok_s"], "gen_tok_s": r["gen_tok_s"],
                     "bytes": (out / name).stat().st_size}
    return res


def _print(result: dict) -> None:
    ours_fp4 = result["ours"]["ours: FP4 weights, fp32 activations"]
    ours_master = result["ours"]["ours: master weights, fp32"]
    print("| model | perplexity | vs ours, same weights | prompt tok/s | generation tok/s |")
    print("|---|---|---|---|---|")
    for label, ppl in result["ours"].items():
        print(f"| {label} | {ppl:.3f} | | | |")
    for name, r in result["llama.cpp"].items():
        ref = ours_fp4 if name == "fp4.gguf" else ours_master
        print(f"| llama.cpp {name} ({result['files'][name]}) | {r['perplexity']:.3f} | "
              f"{100 * (r['perplexity'] / ref - 1):+.3f}% | {r['prompt_tok_s']:.0f} | {r['gen_tok_s']:.0f} |")
    for name, r in result["llama.cpp"].items():
        print(f"{name}: prompt tokenized as ours: {r['prompt_ids_match_ours']}; greedy completion: {r['completion']!r}")
    sp = result.get("speed")
    if sp:
        print(f"speed, random weights, shape {sp['shape']} ({sp['parameters'] / 1e6:.1f}M parameters):")
        for name in ("speed-fp4.gguf", "speed-f16.gguf"):
            r = sp[name]
            print(f"  llama.cpp {name}: {r['bytes'] / 1e6:.1f} MB, prompt {r['prompt_tok_s']:.0f} tok/s, "
                  f"generation {r['gen_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    sys.exit(main())
