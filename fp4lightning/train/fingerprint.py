"""A run's numerics fingerprint: which numbers this code computes on this machine for the recipe's paths.

Two runs may be paired (``fp4lightning compare``, ``compare-join``) only when they computed the same
numbers: the same quantizers, GeMM backend, optimizer-state and gradient-exchange rounding, torch build and
CPU kernels. A commit can change bits without changing the recipe (e.g. multiplying by ``1/s`` instead of
dividing by ``s``), and so can another machine (AVX2 emulating bf16, AMX running it natively), so neither the
recipe nor the commit identifies the numbers. The fingerprint does: at the start of a run, a fixed, seeded set
of calls of every numerics path the run uses, hashed by part:

* ``high``: an ``nn.Linear`` forward and backward under the run's autocast (the head, the attention and
  everything not in FP4 run through these kernels in every run);
* ``fp4``: an :class:`~fp4lightning.nn.linear.FP4Linear` of the run's FP4 recipe (preset and overrides),
  forward and backward, on inputs with outliers (OCC's clamp is exercised), through the backend the run uses
  (the compiled CPU passes where the run compiles them);
* ``states``: two steps of the reduced-precision AdamW of ``optimizer.states`` (not fp32);
* ``comm``: the round trip of a gradient through the exchange's wire format ``trainer.grad_comm`` (not fp32);

plus the environment (torch version, the CPU kernels' instruction set, the device). Two fingerprints
*agree* when their environments are equal and every part both have has the same hash: a ``bf16`` run and a
``paper`` run share the ``high`` part and the environment, a ``paper`` and an ``fp4+all`` run also the
``fp4`` part. :func:`disagreement` names what differs.
"""
from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # computing a fingerprint imports torch; comparing two (compare-join) does not
    import torch

__all__ = ["numerics_fingerprint", "fingerprint_of_recipe", "record_fingerprint", "disagreement", "read_fingerprint",
           "parts_set_apart", "FILE_NAME",
           "FINGERPRINT_VERSION"]

#: the file a run writes beside its checkpoints (``fp4lightning train``)
FILE_NAME = "numerics.json"
#: bumped when the set of calls changes (fingerprints of two versions are never compared part by part)
FINGERPRINT_VERSION = 1
#: the probe layer: tokens x in -> out, sizes every FP4 format takes (multiples of 32)
_TOKENS, _IN, _OUT = 64, 128, 96


def _digest(*tensors: torch.Tensor) -> str:
    import torch

    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu().reshape(-1)
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _inputs(device: torch.device, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Seeded input (with a few outliers, as real activations have), weight, bias and output gradient."""
    import torch

    g = torch.Generator().manual_seed(20250117)
    x = torch.randn(_TOKENS, _IN, generator=g)
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:16]] *= 25.0
    w = torch.randn(_OUT, _IN, generator=g) * 0.05
    b = torch.randn(_OUT, generator=g) * 0.01
    dy = torch.randn(_TOKENS, _OUT, generator=g) * 1e-3
    return tuple(t.to(device=device, dtype=dtype or torch.float32) for t in (x, w, b, dy))


def _linear_part(device: torch.device, autocast: torch.dtype | None, fp4_config=None) -> str:
    """Forward and backward of one linear layer (``FP4Linear`` with ``fp4_config``, else ``nn.Linear``)."""
    import torch

    from fp4lightning.nn.linear import FP4Linear

    x, w, b, dy = _inputs(device)
    layer = torch.nn.Linear(_IN, _OUT, device=device)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    if fp4_config is not None:
        layer = FP4Linear.from_linear(layer, fp4_config)
    x.requires_grad_(True)
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None,
                        cache_enabled=False):
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return _digest(y, x.grad, layer.weight.grad, layer.bias.grad)


def _states_part(states: str, device: torch.device) -> str:
    """Two AdamW steps with reduced-precision moments ``states`` on a seeded parameter and gradients."""
    import torch

    from fp4lightning.lightning.optim import adamw

    _, w, _, _ = _inputs(device)
    p = torch.nn.Parameter(w.clone())
    opt = adamw([p], states, seed=0, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device)
        opt.step()
    moments = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return _digest(p, *moments)


def _comm_part(wire: str, device: torch.device) -> str:
    from fp4lightning.distributed.grad_comm_sim import round_trip_

    x, _, _, _ = _inputs(device)
    grad = x * 1e-3
    return _digest(round_trip_(grad, wire))


def _environment(device: torch.device, backend: str | None) -> dict[str, str]:
    import torch

    env = {"torch": torch.__version__, "device": device.type, "machine": platform.machine()}
    if device.type == "cpu":
        env["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
    else:
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = str(torch.version.cuda)
    if backend is not None:
        env["fp4_backend"] = backend
    return env


def numerics_fingerprint(device: torch.device | str = "cpu", compute_dtype: torch.dtype | str | None = "bfloat16",
                         fp4_config=None, states: str = "fp32", wire: str = "fp32") -> dict[str, Any]:
    """The fingerprint of the paths a run uses (see the module docstring): ``{"hash", "version", "env",
    "parts": {name: hash}}``. ``compute_dtype`` is the run's autocast dtype (None: no autocast, fp32);
    ``fp4_config`` the FP4 recipe (None: no FP4 layers); ``states`` the optimizer-state layout; ``wire``
    the gradient exchange's wire format (:data:`~fp4lightning.distributed.comm.WIRE_FORMATS`)."""
    import torch

    from fp4lightning.distributed.comm import WIRE_FORMATS
    from fp4lightning.numerics.cpu_fused import compile_enabled
    from fp4lightning.ops.gemm import backend_for

    device = torch.device(device)
    if isinstance(compute_dtype, str):
        compute_dtype = getattr(torch, compute_dtype)
    if wire not in WIRE_FORMATS:
        raise ValueError(f"numerics_fingerprint: wire format {wire!r} is not one of {WIRE_FORMATS}")
    with torch.random.fork_rng(devices=[]):  # the run's own random stream is left where it was
        parts = {"high": _linear_part(device, compute_dtype)}
        if fp4_config is not None:
            parts["fp4"] = _linear_part(device, compute_dtype, fp4_config)
        if states != "fp32":
            parts["states"] = _states_part(states, device)
        if wire != "fp32":
            parts["comm"] = _comm_part(wire, device)
    backend = None
    if fp4_config is not None:
        backend = backend_for(device) + (" compiled" if compile_enabled(device) else " eager")
    env = _environment(device, backend)
    whole = hashlib.sha256(json.dumps({"env": env, "parts": parts}, sort_keys=True).encode()).hexdigest()[:16]
    return {"hash": whole, "version": FINGERPRINT_VERSION, "env": env, "parts": parts}


#: the autocast dtype of each Trainer precision the recipes take (None: no autocast)
_AUTOCAST = {"fp4": "bfloat16", "fp4-bf16": "bfloat16", "fp4-fp16": "float16", "bf16-mixed": "bfloat16",
             "16-mixed": "float16", "bf16-true": "bfloat16", "16-true": "float16", "32-true": None, "64-true": None}


def fingerprint_of_recipe(cfg, device: torch.device | str = "cpu") -> dict[str, Any]:
    """:func:`numerics_fingerprint` of the paths the resolved recipe ``cfg`` trains through."""
    from fp4lightning.train.recipe import WIRE_FORMAT  # the recipe's grad_comm names -> wire formats

    precision = cfg.trainer.precision
    fp4 = cfg.fp4_config if precision.startswith("fp4") else None
    return numerics_fingerprint(device, _AUTOCAST.get(precision, "bfloat16"), fp4, cfg.optimizer.states,
                                WIRE_FORMAT[cfg.trainer.grad_comm])


#: the recipe overrides that choose what each part computes (the ``fp4`` part: the FP4 recipe; ``states``:
#: the optimizer-state layout; ``comm``: the gradient wire format)
_PART_KEYS = {"fp4": ("trainer.precision", "fp4."), "states": ("optimizer.states",), "comm": ("trainer.grad_comm",)}


def parts_set_apart(overrides_a: list[str], overrides_b: list[str]) -> set[str]:
    """The parts two runs' recipe overrides (``key=value`` strings) make compute different things on
    purpose: two FP4 recipes (``nvfp4`` and ``mxfp4``), two optimizer-state layouts, two wire formats. Their
    hashes differ on every machine, so they say nothing about the machine or the code, and
    :func:`disagreement` leaves them out."""
    def chosen(overrides, prefixes):
        return sorted(o for o in overrides if o.split("=", 1)[0].startswith(prefixes))
    return {part for part, prefixes in _PART_KEYS.items()
            if chosen(overrides_a, prefixes) != chosen(overrides_b, prefixes)}


def disagreement(a: dict | None, b: dict | None, set_apart: set[str] | frozenset = frozenset()) -> str | None:
    """None when fingerprints ``a`` and ``b`` agree (same environment, same hash for every part both
    have, but the parts ``set_apart`` that the two runs' recipes choose differently:
    :func:`parts_set_apart`); else what differs, in words. A missing fingerprint (a run from before they
    were recorded) cannot be shown to agree."""
    if not a or not b:
        return "no numerics fingerprint recorded" + ("" if (a or b) else " for either run")
    for fp in (a, b):
        if fp.get("resumed_from"):
            later = {k: v for k, v in fp.items() if k != "resumed_from"}
            return f"a run resumed with other numerics than it started with ({disagreement(fp['resumed_from'], later)})"
    if a.get("version") != b.get("version"):
        return f"fingerprint versions {a.get('version')} and {b.get('version')}"
    env_a, env_b = a.get("env", {}), b.get("env", {})
    diffs = [f"{k} {env_a.get(k, '(unset)')} vs {env_b.get(k, '(unset)')}"
             for k in sorted(set(env_a) | set(env_b))
             if env_a.get(k) != env_b.get(k) and (k in env_a and k in env_b or k != "fp4_backend")]
    pa, pb = a.get("parts", {}), b.get("parts", {})
    diffs += [f"the {k} path's numbers" for k in sorted((set(pa) & set(pb)) - set(set_apart)) if pa[k] != pb[k]]
    return "; ".join(diffs) or None


def read_fingerprint(run_dir: str | Path) -> dict | None:
    """The fingerprint a run recorded in ``run_dir`` (None where it recorded none, or it is unreadable)."""
    path = Path(run_dir) / FILE_NAME
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "parts" in doc else None


def record_fingerprint(cfg, device: torch.device | str, run_dir: str | Path) -> dict[str, Any]:
    """Compute the recipe's fingerprint on ``device``, write it to ``run_dir``/numerics.json and print it
    in one line (``fp4lightning train`` does this before the first step)."""
    fp = fingerprint_of_recipe(cfg, device)
    path = Path(run_dir) / FILE_NAME
    earlier = read_fingerprint(run_dir)  # a resumed run's first part
    if earlier is not None and earlier.get("hash") != fp["hash"]:
        first = {k: v for k, v in earlier.items() if k != "resumed_from"}
        print(f"numerics fingerprint: this run was started with other numerics ({disagreement(first, fp)}); "
              "compare pairs it only with --allow-mixed-numerics", flush=True)
        fp["resumed_from"] = first
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE_NAME}.tmp")
    tmp.write_text(json.dumps(fp, indent=1) + "\n")
    tmp.replace(path)
    env = ", ".join(f"{k} {v}" for k, v in fp["env"].items())
    print(f"numerics fingerprint {fp['hash']} ({', '.join(f'{k} {v}' for k, v in fp['parts'].items())}; {env})",
          flush=True)
    return fp
