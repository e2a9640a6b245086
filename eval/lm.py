"""lm-evaluation-harness model ``fp4lightning``: score our checkpoints with our forward pass.

The paper reports zero-shot accuracy and perplexity of FP4-trained models next to BF16
ones, measured with the lm-evaluation-harness (arXiv 2501.17116, section 7). Exporting to
Hugging Face format would run every GeMM in high precision; this model instead runs our
own :class:`~fp4lightning.models.llama.Llama`, so an FP4 model can be scored with its FP4
GeMMs (``linear=fp4``) or with the same weights in high precision (``linear=high``).

Request handling mirrors lm-eval's own ``hf`` model (``lm_eval/models/huggingface.py``):

* ``loglikelihood``: context and continuation are tokenized together and split at the
  context's token count (``TemplateLM._encode_pair``: trailing spaces move to the
  continuation); the context starts with BOS, as every training document did. Requests
  are sorted longest first by :class:`lm_eval.models.utils.Collator`, right-padded into
  batches (causal attention keeps padding from touching real positions), and requests
  that share ``context + continuation[:-1]`` share one forward pass.
* ``loglikelihood_rolling``: the text (without BOS) is cut by
  ``lm_eval.utils.get_rolling_token_windows`` into windows of ``max_length`` tokens, the
  first conditioned on BOS, each token predicted exactly once with the most context.
* ``generate_until``: greedy decoding, batched and right-padded, stopping at EOS, at any
  stop string, or after ``max_gen_toks``; the context slides when it outgrows the model.

FP4 caveat: OCC clamps activations at quantiles of the whole activation tensor
(section 3.3), so with ``linear=fp4`` a request's score depends slightly on the other
requests in its batch, exactly as a training step's does. ``linear=high`` is
batch-invariant up to float rounding.

Usage: ``lm_eval.simple_evaluate(model="fp4lightning", model_args="pretrained=run/last.ckpt,linear=fp4")``
after ``import fp4lightning.eval.lm``; or ``fp4lightning eval CKPT``; or
``python -m fp4lightning.eval.lm_eval_cli run --model fp4lightning --model_args pretrained=CKPT ...``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from torch import nn
from tqdm import tqdm

from fp4lightning.config import FP4Config
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.errors import InputNotFoundError, UsageError
from fp4lightning.models.llama import Llama
from fp4lightning.nn.convert import convert_to_fp4
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_linears
from fp4lightning.train.checkpoint import load_checkpoint
from fp4lightning.train.preflight import check_checkpoint_path

__all__ = ["FP4LightningLM", "LINEAR_MODES", "to_high_precision", "load_model_and_tokenizer", "quiet_git_hash"]

log = logging.getLogger(__name__)

#: ``linear=`` choices: as trained, force FP4 GeMMs, or plain ``nn.Linear`` on the same weights
LINEAR_MODES = ("auto", "fp4", "high")
_DTYPES = {"float32": None, "fp32": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- loading
def to_high_precision(model: nn.Module) -> nn.Module:
    """Swap every ``FP4Linear`` in ``model`` back to ``nn.Linear``, in place, sharing the weights.

    ``FP4Linear`` keeps its high-precision master weight as ``weight``, so the swap
    gives exactly the model a BF16 run of the same weights would evaluate.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FP4Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                lin.weight = child.weight
                lin.bias = child.bias
                setattr(parent, name, lin)
    return model


def load_model_and_tokenizer(
    checkpoint: str | Path, tokenizer: str | Path | Tokenizer | None = None, map_location: str = "cpu"
) -> tuple[nn.Module, Tokenizer, dict]:
    """``(model, tokenizer, info)`` from one of our checkpoints, built as it trained.

    A run trained in FP4 comes back with its ``FP4Linear`` layers (its own FP4 recipe).
    ``info``: ``trained_fp4`` (bool), ``recipe`` (the run's ``RecipeConfig`` or None),
    ``checkpoint`` (the path). ``tokenizer`` overrides the one embedded in the checkpoint
    (a ``tokenizer.json`` path, a data directory holding one, or a :class:`Tokenizer`).
    Missing files raise ``FileNotFoundError`` saying what to pass.
    """
    path = Path(checkpoint)
    check_checkpoint_path(path)
    tok_override = _load_tokenizer(tokenizer) if tokenizer is not None else None
    model, tok, recipe = load_checkpoint(path, map_location=map_location, fp4=True)
    tok = tok_override or tok
    if tok is None:
        raise InputNotFoundError(
            f"checkpoint {path} carries no tokenizer and none was found beside it; pass "
            "tokenizer=<data_dir>/tokenizer.json (the tokenizer of the data the model was trained on; "
            "--tokenizer for fp4lightning eval)"
        )
    if tok.vocab_size > model.config.vocab_size:
        raise UsageError(
            f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {model.config.vocab_size}: "
            "pass the tokenizer the checkpoint was trained with"
        )
    info = {"trained_fp4": any(isinstance(m, FP4Linear) for m in model.modules()), "recipe": recipe,
            "checkpoint": str(path)}
    return model, tok, info


def _load_tokenizer(tokenizer: str | Path | Tokenizer) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    tpath = Path(tokenizer)
    if tpath.is_dir():
        tpath = tpath / "tokenizer.json"
    if not tpath.is_file():
        raise InputNotFoundError(
            f"tokenizer file {tpath} not found; pass tokenizer=<data_dir>/tokenizer.json "
            "(written by `fp4lightning data prepare`)"
        )
    return Tokenizer.from_file(tpath)


def _fp4_config_of(model: nn.Module):
    for m in model.modules():
        if isinstance(m, FP4Linear):
            return m.config
    return None


def _check_model_args(pretrained, linear: str, dtype: str, unknown: dict) -> None:
    if pretrained is None:
        raise UsageError("the fp4lightning model needs pretrained=<checkpoint path> (model_args)")
    if linear not in LINEAR_MODES:
        raise UsageError(f"linear={linear!r} is not one of {LINEAR_MODES}")
    if str(dtype) not in _DTYPES:
        raise UsageError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if unknown:
        log.warning("fp4lightning model: ignoring unknown model_args %s", sorted(unknown))


def _load_pretrained(pretrained: str | Path | nn.Module, tokenizer) -> tuple[nn.Module, Tokenizer, dict]:
    """``(model, tokenizer, info)`` as :func:`load_model_and_tokenizer`, or of a model object (with ``tokenizer``)."""
    if not isinstance(pretrained, nn.Module):
        return load_model_and_tokenizer(pretrained, tokenizer)
    if tokenizer is None:
        raise UsageError("pass tokenizer=... (a Tokenizer or tokenizer.json path) with a model object")
    info = {"trained_fp4": _fp4_config_of(pretrained) is not None, "recipe": None, "checkpoint": None}
    return pretrained, _load_tokenizer(tokenizer), info


def _set_linear_mode(model: nn.Module, linear: str, fp4_preset: str | None) -> None:
    """``linear=high``: plain ``nn.Linear`` layers; ``fp4``: FP4 layers (a high-precision model converted
    with ``fp4_preset``, default ``paper``); ``auto``: as trained. In place."""
    if linear == "high":
        to_high_precision(model)
    elif linear == "fp4" and _fp4_config_of(model) is None:
        convert_to_fp4(model, FP4Config.from_preset(fp4_preset or "paper"))  # warns only on shape skips
    elif fp4_preset is not None:
        log.warning("fp4_preset=%s ignored: it only applies to linear=fp4 on a model trained in high precision",
                    fp4_preset)


# ----------------------------------------------------------------------------- the model
@register_model("fp4lightning")
class FP4LightningLM(TemplateLM):
    """lm-eval model over one of our checkpoints (see the module docstring).

    Args (all also accepted as ``model_args`` strings):
        pretrained: a checkpoint written by training (``.ckpt`` file or run folder), or a
            :class:`Llama` instance (then ``tokenizer`` is required).
        tokenizer: ``tokenizer.json`` path or :class:`Tokenizer`; default: the checkpoint's own.
        linear: ``auto`` (as trained: FP4 GeMMs for an FP4 run), ``fp4`` (FP4 GeMMs; a model
            trained in high precision is converted with ``fp4_preset``) or ``high`` (every
            ``FP4Linear`` becomes an ``nn.Linear`` on the same master weights).
        fp4_preset: FP4 recipe for ``linear=fp4`` on a model trained without one (default ``paper``).
        dtype: ``float32`` (default) or ``bfloat16`` / ``float16`` autocast around the forward.
        batch_size: requests per forward pass, or ``auto`` (also ``auto:N``, as lm-eval's ``hf``
            model takes it): the largest power of two up to ``max_batch_size`` (default 64)
            whose forward pass at ``max_length`` fits (:meth:`detect_batch_size`).
            max_length: context window (default: the model's ``max_seq_len``). device: default
            CUDA if available, else CPU.
        add_bos_token: start contexts with BOS (default True: training documents do).
        logits_cache: share one forward among requests with equal ``context + continuation[:-1]``.
    """

    backend = "causal"

    def __init__(
        self,
        pretrained: str | Path | Llama | None = None,
        tokenizer: str | Path | Tokenizer | None = None,
        linear: str = "auto",
        fp4_preset: str | None = None,
        dtype: str = "float32",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        add_bos_token: bool | str = True,
        logits_cache: bool | str = True,
        **kwargs,
    ):
        super().__init__()
        _check_model_args(pretrained, linear, dtype, kwargs)
        self._batch_size = _parse_batch_size(batch_size)  # None: "auto", settled once the model is loaded
        self._max_batch_size = _parse_batch_size(max_batch_size) if max_batch_size else 64
        self._device = _pick_device(device)
        self._autocast_dtype = _DTYPES[str(dtype)]
        self.add_bos_token = _as_bool(add_bos_token)
        self.logits_cache = _as_bool(logits_cache)
        self._max_gen_toks = int(max_gen_toks)

        model, tok, info = _load_pretrained(pretrained, tokenizer)
        self.checkpoint, self.recipe, self.trained_fp4 = info["checkpoint"], info["recipe"], info["trained_fp4"]
        _set_linear_mode(model, linear, fp4_preset)
        if self._autocast_dtype == torch.bfloat16 and self._device.type == "cpu":
            emulate_bf16_linears(model)  # CPUs without native bf16 GeMMs (docs/lightning.md)
        fp4_cfg = _fp4_config_of(model)
        self.linear = "fp4" if fp4_cfg is not None else "high"
        self.fp4_config = dataclasses.asdict(fp4_cfg) if fp4_cfg is not None else None
        self.model = model.to(self._device).eval()
        self.tokenizer = tok
        cfg = getattr(model, "config", None)
        model_max = int(getattr(cfg, "max_seq_len", 2048))
        self._max_length = int(max_length) if max_length else model_max
        if not 1 < self._max_length <= model_max:
            raise UsageError(f"max_length={max_length} must be in [2, {model_max}] (the model's max_seq_len)")
        self.vocab_size = tok.vocab_size
        if self._batch_size is None:
            self._batch_size = self.detect_batch_size()
            log.info("fp4lightning model: batch_size=auto chose %d", self._batch_size)

    # ------------------------------------------------------------------ properties lm-eval uses
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return "fp4lightning-" + hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:16]

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return None  # base models: no chat template

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values()),
            "model_dtype": str(self._autocast_dtype or next(self.model.parameters()).dtype),
            "linear": self.linear,
            "trained_fp4": self.trained_fp4,
            "fp4_config": self.fp4_config,
            "checkpoint": self.checkpoint,
        }

    # ------------------------------------------------------------------ tokenization
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """Token ids of ``string``; BOS first when ``add_special_tokens`` (default: ``add_bos_token``)."""
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self.tokenizer.bos_token):
            add_bos = False  # already there, as in the hf model
        ids = self.tokenizer.encode(string, bos=add_bos, eos=False)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ forward
    def detect_batch_size(self) -> int:
        """The largest power of two <= ``max_batch_size`` whose forward pass at ``max_length`` fits.

        On CUDA each candidate runs once and an out-of-memory error halves it, as lm-eval's
        ``hf`` model does. A CPU has no such error (the process is killed or swaps), so
        candidates whose logits and activations would exceed a quarter of the available
        memory are skipped before being tried.
        """
        cfg = getattr(self.model, "config", None)
        dim, layers = int(getattr(cfg, "dim", 1024)), int(getattr(cfg, "n_layers", 1))
        # float32 logits + log-softmax copy, and ~24 activations of width dim per layer
        per_seq = self._max_length * (3 * self.vocab_size + 24 * dim * layers) * 4
        budget = None
        if self._device.type == "cpu":
            try:
                budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
            except (ValueError, OSError, AttributeError):
                budget = 4 << 30
        bs = 1 << (self._max_batch_size.bit_length() - 1)
        while bs > 1:
            if budget is not None and bs * per_seq > budget:
                bs //= 2
                continue
            try:
                self._model_call(torch.zeros(bs, self._max_length, dtype=torch.long, device=self._device))
                break
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                    raise
                if self._device.type == "cuda":
                    torch.cuda.empty_cache()
                bs //= 2
        return max(bs, 1)

    def _model_call(self, inps: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` of a ``(B, T)`` batch, float32."""
        with torch.no_grad(), torch.autocast(
            self._device.type, dtype=self._autocast_dtype or torch.bfloat16, enabled=self._autocast_dtype is not None
        ):
            return self.model(inps).float()

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), continuation is greedy)`` per tokenized request."""
        res: list[tuple[float, bool]] = []

        def _collate(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)  # longest first: the first batch shows the peak memory

        re_ord = Collator(
            requests,
            sort_fn=_collate,
            group_by="contexts" if self.logits_cache else None,
            group_fn=lambda req: req[-2] + req[-1][:-1],
        )
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        warned = False
        for chunk in re_ord.get_batched(n=override_bs or self.batch_size):
            inps, warned = self._request_inputs(chunk, warned)
            logprobs = F.log_softmax(self._model_call(_right_padded(inps).to(self._device)), dim=-1)  # (B, T, V)
            for (req_str, ctx_toks, cont_toks), lp, inp in zip(chunk, logprobs, inps):
                lp = lp[len(inp) - len(cont_toks) : len(inp)]  # (contlen, V): drop context and padding
                for name, answer in self._scores(re_ord, req_str, ctx_toks, cont_toks, lp):
                    res.append(answer)
                    if name is not None:
                        self.cache_hook.add_partial("loglikelihood", name, answer)
                    pbar.update(1)
        pbar.close()
        return re_ord.get_original(res)

    def _request_inputs(self, chunk: list, warned: bool) -> tuple[list[list[int]], bool]:
        """The model input of each ``(request, context, continuation)`` of ``chunk``: context + continuation
        without its last token, cut from the left to ``max_length``; warns about a cut once (``warned``)."""
        inps = []
        for req_str, context_enc, continuation_enc in chunk:
            if not context_enc or not continuation_enc:
                raise UsageError(
                    f"request {req_str!r} tokenized to an empty context or continuation "
                    f"({len(context_enc)} / {len(continuation_enc)} tokens)"
                )
            if len(continuation_enc) > self.max_length:
                raise UsageError(f"a continuation of {len(continuation_enc)} tokens exceeds max_length={self.max_length}")
            if len(context_enc) + len(continuation_enc) > self.max_length + 1 and not warned:
                log.warning("context + continuation longer than max_length=%d: truncating contexts from the left",
                            self.max_length)
                warned = True
            # the last token is only ever a target, never an input
            inps.append((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
        return inps, warned

    @staticmethod
    def _scores(re_ord: Collator, req_str, ctx_toks: list[int], cont_toks: list[int], lp: torch.Tensor):
        """``(request, (log-likelihood, greedy))`` of one request and of every request sharing its forward
        pass (lm-eval's logits cache); ``lp``: the log-probabilities at the continuation, (contlen, V)."""
        lp = lp.unsqueeze(0)  # (1, contlen, V)
        greedy = lp.argmax(dim=-1)
        for req_str, cont_toks, lp in re_ord.get_cache(req_str=req_str, cxt_toks=ctx_toks, cont_toks=cont_toks,
                                                      logits=lp):
            n = len(cont_toks)
            ct = torch.tensor(cont_toks, dtype=torch.long, device=lp.device).unsqueeze(0)  # (1, n)
            # a shared forward may carry a longer continuation: score the last n positions
            lp_n = lp[:, -n:]
            yield req_str, (float(torch.gather(lp_n, 2, ct.unsqueeze(-1)).sum()), bool((greedy[:, -n:] == ct).all()))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts (conditioned on BOS) through disjoint rolling windows."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts: list[int] = []
        for (string,) in [req.args for req in requests]:
            toks = self.tok_encode(string, add_special_tokens=False)
            ws = [
                (None, ctx, cont)
                for ctx, cont in map(
                    lm_utils.make_disjoint_window,
                    lm_utils.get_rolling_token_windows(
                        token_list=toks, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                    ),
                )
            ]
            windows.extend(ws)
            counts.append(len(ws))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, pos = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[pos : pos + n])
            pos += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def greedy_generate(self, contexts: list[list[int]], max_new_tokens: int, stop: list[str]) -> list[list[int]]:
        """Greedy continuations of token contexts, batched; a row stops at EOS or a stop string."""
        gen: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        stop = [s for s in stop if s]
        for _ in range(max_new_tokens):
            if not active:
                break
            # no KV cache: each step re-reads the (sliding) window, right-padded
            rows = [(contexts[i] + gen[i])[-self.max_length:] for i in active]
            lens = torch.tensor([len(r) for r in rows])
            logits = self._model_call(_right_padded(rows).to(self._device)).cpu()  # (b, T, V)
            last = logits[torch.arange(len(rows)), lens - 1, : self.vocab_size]  # ids past the tokenizer never decode
            nxt = last.argmax(dim=-1).tolist()
            still = []
            for i, t in zip(active, nxt):
                gen[i].append(t)
                if t == self.eot_token_id:
                    continue
                if stop and any(s in self.tok_decode(gen[i]) for s in stop):
                    continue
                still.append(i)
            active = still
        return gen

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation per request until one of its ``until`` strings (or EOS)."""
        res: list[str] = []
        re_ords = Collator(
            [req.args for req in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda req: req[1],
        )
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in re_ords.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            gen_kwargs = copy.deepcopy(all_kwargs[0])
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample"):
                log.warning("fp4lightning model: do_sample=True requested; decoding greedily")
            ctx_ids = [self.tok_encode(c)[-self.max_length:] for c in contexts]
            for context, toks in zip(contexts, self.greedy_generate(ctx_ids, max_gen, until)):
                s = postprocess_generated_text(self.tok_decode(toks), stop=until, think_end_token=None)
                res.append(s)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), s)
                pbar.update(1)
        pbar.close()
        return re_ords.get_original(res)


def _right_padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows as one (len(rows), longest) batch, padded on the right with 0 (causal attention keeps
    the padding from touching the real positions)."""
    batch = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return batch


def _git_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` with git's complaints kept off the terminal: ``git describe
    --always`` in the working directory, else lm-eval's reading of a ``.git`` folder there."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        proc = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    except OSError:  # no git on this machine
        proc = None
    if proc is not None and proc.returncode == 0:
        return proc.stdout.strip()
    return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_git_hash() -> Iterator[None]:
    """Inside the block, ``lm_eval.simple_evaluate`` records the working directory's git commit
    without printing git's "fatal: not a git repository" when it is not in one.

    lm-eval runs ``git describe`` with git's stderr left on the terminal, so every evaluation
    outside a git checkout printed that line. Its evaluator looks the function up by name, which
    is what is swapped here, and put back on leaving the block.
    """
    import lm_eval.evaluator as evaluator

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = _git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def _pick_device(device: str | None) -> torch.device:
    # lm-eval's CLI passes device="cuda" by default; like its hf model, fall back to the CPU
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s requested but CUDA is not available: running on the CPU", device)
        return torch.device("cpu")
    return dev


def _parse_batch_size(batch_size: int | str) -> int | None:
    """An integer batch size, or None for ``auto`` / ``auto:N``."""
    if isinstance(batch_size, str):
        if batch_size.strip().startswith("auto"):
            return None
        try:
            batch_size = int(batch_size)
        except ValueError:
            raise UsageError(f"batch_size must be an integer or auto, got {batch_size!r}") from None
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    return int(batch_size)


def _as_bool(v: bool | str) -> bool:
    if isinstance(v, str):
        if v.lower() in ("true", "1", "yes"):
            return True
        if v.lower() in ("false", "0", "no"):
            return False
        raise UsageError(f"expected a boolean, got {v!r}")
    return bool(v)
