"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models with ``FP4Linear`` layers, and an FP4 weight
all-gather (arXiv 2501.17116, section 3; this project's docs/distributed.md).

FSDP2 shards every parameter along dim 0. For a linear weight ``W`` (out x in) that is the output-channel
dimension, and the paper's weight quantizer is per output channel (section 3.1): the scale of a row
depends on that row only. So a rank can quantize its own rows locally and get exactly the codes and
scales that quantizing the gathered weight would give. :class:`FP4ShardedWeight` uses FSDP2's
all-gather extension points (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, the hooks torchao's
float8 training uses) to all-gather packed E2M1 codes (half a byte per element) plus one fp32 scale per
row instead of the bf16 weight: ``N*K/2 + 4N`` bytes against ``2*N*K``, about 0.25-0.27x. The unsharded
weight is an :class:`FP4GatheredWeight` that carries the codes; ``FP4Linear`` runs its GeMMs on them
directly, so the forward is bitwise the one of "all-gather bf16, then quantize".

DGE (section 3.2) multiplies the weight gradient element-wise by ``f'(W * s_w)``, which needs the
high-precision weight, and only the local shard of it exists after an FP4 all-gather. The factor is
element-wise, so it commutes with the gradient sum: the layer computes the straight-through gradient,
FSDP2 reduce-scatters it, and a post-reduce-scatter hook (``set_all_reduce_hook``) multiplies each rank's
gradient shard by the DGE factor of its own weight rows. Same value as the unsharded layer's gradient
up to fp32 rounding order.

Entry point: :func:`fully_shard_fp4` (used by :class:`~fp4lightning.train.module.LlamaLightningModule` under
Lightning's ``ModelParallelStrategy`` and usable from a plain ``torchrun`` script).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fp4lightning.distributed.comm import ring_all_reduce_bytes
from fp4lightning.distributed.fp8_codec import FP8_FORMATS, decode_sum_into, encode_fp8_into, pow2_scales
from fp4lightning.nn.linear import FP4Linear, quantize_weight
from fp4lightning.numerics.dge import dge_derivative

__all__ = [
    "FP4ShardedWeight",
    "FP4GatheredWeight",
    "AllGatherStats",
    "fully_shard_fp4",
    "fp4_all_gather_bytes",
    "bf16_all_gather_bytes",
    "FP8ReduceScatter",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

# ops whose outputs keep the FP4ShardedWeight wrapper (FSDP2's sharding and copying of the parameter);
# everything else (optimizer arithmetic, norms) runs on and returns plain tensors
_PRESERVE = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


def fp4_all_gather_bytes(out_features: int, in_features: int, world: int) -> int:
    """Bytes one rank receives when all-gathering an (out x in) weight as packed FP4 codes + fp32 row scales."""
    rows = out_features // world
    return (world - 1) * (rows * ((in_features + 1) // 2) + 4 * rows)


def bf16_all_gather_bytes(out_features: int, in_features: int, world: int) -> int:
    """Bytes one rank receives when all-gathering an (out x in) weight in bf16."""
    return (world - 1) * (out_features // world) * in_features * 2


@dataclass
class AllGatherStats:
    """Bytes that FP4 all-gathers moved into this rank (``(W-1)/W`` of every gathered payload)."""

    fp4_bytes: int = 0
    bf16_equivalent_bytes: int = 0
    gathers: int = 0
    dge_reduce_scatters: int = 0  # reduce-scatters whose output got the sharded DGE factor
    grad_bytes: int = 0  # sent by this rank in FP8 gradient reduce-scatters (payload + amax all-reduce)
    grad_fp32_bytes: int = 0  # what the same reduce-scatters send in fp32

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class FP4ShardedWeight(torch.Tensor):
    """A dim-0 shard of an ``FP4Linear`` weight that FSDP2 all-gathers as packed FP4 codes + row scales.

    Behaves as its high-precision shard for every op (optimizer, clipping, checkpoints); only FSDP2's
    all-gather sees the extension methods. ``stats`` (shared per model) counts the bytes received.
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, stats: AllGatherStats, world: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, stats: AllGatherStats, world: int):
        self._tensor = tensor
        self._stats = stats
        self._world = world

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FP4ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ref = next(a for a in _flat(args, kwargs) if isinstance(a, cls))

        def unwrap(t):
            return t._tensor if isinstance(t, cls) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func not in _PRESERVE:
            return out
        return tree_map(lambda t: cls(t, ref._stats, ref._world) if type(t) is torch.Tensor else t, out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._stats, self._world)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FP4ShardedWeight(inner_tensors["_tensor"], *meta)

    def __reduce_ex__(self, protocol):  # checkpoints hold the plain high-precision shard
        return self._tensor.__reduce_ex__(protocol)

    # --- FSDP2 extension points
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self._tensor.dtype
        # exactly what FP4Linear does to the gathered weight, on this rank's rows
        codes, scale, _ = quantize_weight(self._tensor.to(dtype), module.config)
        n, k = outer_size
        self._stats.fp4_bytes += fp4_all_gather_bytes(n, k, self._world)
        self._stats.bf16_equivalent_bytes += bf16_all_gather_bytes(n, k, self._world)
        self._stats.gathers += 1
        return (codes, scale.view(-1, 1)), (tuple(outer_size), dtype)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scale = all_gather_outputs
        shape, dtype = metadata
        if out is not None:  # FSDP2 refilled the same buffers: nothing to rebuild
            return
        return FP4GatheredWeight(codes, scale.view(-1), shape, dtype), (codes, scale)


class FP4GatheredWeight(torch.Tensor):
    """The unsharded weight of an ``FP4Linear`` after an FP4 all-gather: packed codes + per-row scales.

    ``fp4_weight_quant`` is the ``(codes, scale, None)`` triple ``FP4Linear`` would have computed from
    the full weight; there is no high-precision copy, so any other use raises.
    """

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device, requires_grad=False)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, shape, dtype):
        self._codes = codes
        self._scale = scale
        self._shape = tuple(shape)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def fp4_weight_quant(self) -> tuple:
        return (self._codes, self._scale, None)

    def __repr__(self) -> str:
        return f"FP4GatheredWeight(shape={self._shape}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        if func in (aten.detach.default, aten.alias.default) or (
            func is aten.as_strided.default and tuple(args[1]) == me._shape
        ):
            return cls(me._codes, me._scale, me._shape, me.dtype)
        raise NotImplementedError(
            f"{func} on an FP4 all-gathered weight (it holds only packed codes and scales); "
            "call fully_shard_fp4(..., fp4_all_gather=False) to gather the high-precision weight"
        )

    def __tensor_flatten__(self):
        return ["_codes", "_scale"], (self._shape, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP4GatheredWeight(inner["_codes"], inner["_scale"], *meta)


def _flat(args, kwargs) -> Iterable[Any]:
    return tree_leaves((args, kwargs))


def _wrap_weights(module: nn.Module, stats: AllGatherStats, world: int) -> list[FP4Linear]:
    """Swap each eligible FP4Linear's weight for an FP4ShardedWeight (before fully_shard shards it)."""
    wrapped = []
    for fqn, m in module.named_modules():
        if not isinstance(m, FP4Linear) or isinstance(m.weight.data, FP4ShardedWeight):
            continue
        cfg = m.config
        if cfg.weight_granularity != "per_channel":
            log.warning("fully_shard_fp4: %s has per-tensor weight scales; gathering it in high precision", fqn)
            continue
        if m.out_features % world:
            log.warning("fully_shard_fp4: %s out_features=%d not divisible by %d ranks; gathering it in high "
                        "precision", fqn, m.out_features, world)
            continue
        w = m.weight
        m.weight = nn.Parameter(FP4ShardedWeight(w.data, stats, world), requires_grad=w.requires_grad)
        if cfg.dge:
            # the gathered weight has no high-precision values: the layer computes the straight-through
            # gradient and _dge_hook applies DGE's factor to the reduce-scattered shard
            m._sharded_dge = (cfg.dge_k, cfg.dge_clamp)
            m.config = dataclasses.replace(cfg, dge=False)
        wrapped.append(m)
    return wrapped


def _param_group(unit: nn.Module):
    """FSDP2's parameter group of a ``fully_shard``-ed module (None when it holds no parameters of its own).

    FSDP2 has no public way to walk a unit's sharded parameters in reduce-scatter order, which the DGE
    hook and the FP8 reduce-scatter need, so this reads its internals (``_get_fsdp_state``,
    ``_fsdp_param_group``, and on each ``FSDPParam`` ``_module_info``, ``_sharded_param_data``,
    ``padded_sharded_param_size``), checked against the torch of constraints.txt. Another torch may
    rename them: then this raises with the version instead of failing somewhere inside a backward."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            fp._module_info.module, fp._module_info.param_name, fp.padded_sharded_param_size  # noqa: B018
    except AttributeError as e:
        raise RuntimeError(
            f"fully_shard_fp4: this torch ({torch.__version__}) lays out FSDP2's internals differently from the "
            f"one fp4lightning was tested with ({e}). Install the torch pinned in constraints.txt, or call "
            "fully_shard_fp4(..., fp4_all_gather=False, grad_format='fp32') (plain FSDP2, no FP4 all-gather, "
            "DGE or FP8 reduce-scatter hooks)") from e
    return group


@torch.no_grad()
def _dge_hook(fsdp_module: nn.Module, stats: AllGatherStats):
    """Post-reduce-scatter hook: multiply each FP4-gathered weight's gradient shard by f'(W_shard s_w)."""
    group = _param_group(fsdp_module)
    if group is None or not any(getattr(fp._module_info.module, "_sharded_dge", None) for fp in group.fsdp_params):
        return None

    def hook(reduce_output: torch.Tensor) -> None:
        stats.dge_reduce_scatters += 1
        offset = 0
        for fp in group.fsdp_params:
            numel = fp.padded_sharded_param_size.numel()
            m = fp._module_info.module
            dge = getattr(m, "_sharded_dge", None)
            if dge is not None and fp._module_info.param_name == "weight":
                local = fp._sharded_param_data.view(fp.padded_sharded_param_size)
                w = local._tensor if isinstance(local, FP4ShardedWeight) else local
                dtype = fp.param_dtype or w.dtype
                wq = w.to(dtype)
                _, scale, _ = quantize_weight(wq, dataclasses.replace(m.config, dge=True))
                factor = dge_derivative(wq.float() * scale[:, None], dge[0], dge[1])
                seg = reduce_output[offset:offset + numel].view_as(factor)
                seg.copy_((seg.float() * factor).to(seg.dtype))
            offset += numel

    return hook


try:  # FSDP2's comm interface (torch >= 2.8); not re-exported from torch.distributed.fsdp
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover
    _ReduceScatterBase = object


class FP8ReduceScatter(_ReduceScatterBase):
    """FSDP2 gradient reduce-scatter with FP8 on the wire (``FSDPModule.set_custom_reduce_scatter``).

    The scheme of the DDP hook (:mod:`fp4lightning.distributed.comm`; FP8 gradient communication as in arXiv 2501.17116): one amax per
    parameter (over every rank's gradient) agreed with one ``all_reduce(MAX)``, a common power-of-two
    scale, E4M3 (or E5M2) codes sent as ``uint8`` with ``all_to_all_single`` (gloo and NCCL have no FP8
    sum), decoded and summed in fp32 by the rank that owns the shard. Each rank sends ``(W-1)/W`` of the
    unit's gradient bytes at 1 byte per element: a quarter of fp32. A non-finite gradient on any rank makes
    the shard NaN on every rank (the loss scaler or the optimizer step sees it everywhere).
    """

    def __init__(self, group_params, fmt: str, stats: AllGatherStats):
        if fmt not in FP8_FORMATS:
            raise ValueError(f"grad_format={fmt!r}: FP8 reduce-scatter takes one of {tuple(FP8_FORMATS)}")
        self.fmt = fmt
        self.sizes = [fp.padded_sharded_param_size.numel() for fp in group_params]
        self.stats = stats

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = group.size()
        n = output_tensor.numel()
        if sum(self.sizes) != n:
            raise RuntimeError(f"FP8ReduceScatter: layout of {sum(self.sizes)} elements, got a {n}-element shard")
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise NotImplementedError(f"FP8ReduceScatter supports AVG and SUM, not {op}; leave "
                                      "set_gradient_divide_factor unset")
        dtype8, fmax = FP8_FORMATS[self.fmt]
        x = input_tensor.view(world, n)  # row r: the part rank r owns
        segs = x.split(self.sizes, dim=1)
        amax = torch.stack([s.abs().amax().float() if s.numel() else x.new_zeros((), dtype=torch.float32)
                            for s in segs])
        flag = (~torch.isfinite(amax).all()).float().view(1)
        red = torch.cat([torch.nan_to_num(amax, nan=0.0, posinf=0.0), flag])
        dist.all_reduce(red, op=dist.ReduceOp.MAX, group=group)
        sent = ring_all_reduce_bytes(red.numel(), 4, world)
        if red[-1].item() > 0:
            output_tensor.fill_(float("nan"))
            self._count(sent, n, world)
            return None
        scales = pow2_scales(red[:-1], fmax)
        codes = torch.empty(world, n, dtype=torch.uint8, device=x.device)
        for seg, sc, c in zip(segs, scales, codes.split(self.sizes, dim=1)):
            encode_fp8_into(seg, sc, c, fmax, dtype8)  # one compiled loop per parameter on CPU
        received = torch.empty(world, n, dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(received, codes, group=group)
        divisor = world if op == dist.ReduceOp.AVG else 1
        inv = (1.0 / scales.double()).float()  # powers of two: exact
        for out, rows, m in zip(output_tensor.view(n).split(self.sizes), received.split(self.sizes, dim=1), inv):
            decode_sum_into(rows, m.expand(world), out, dtype8, divisor)  # rank order: the same everywhere
        self._count(sent + (world - 1) * n, n, world)
        return None

    def _count(self, sent: int, n: int, world: int) -> None:
        self.stats.grad_bytes += sent
        self.stats.grad_fp32_bytes += (world - 1) * n * 4


def _checkpointed(forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _drop_weight_cache(module: nn.Module, args: Any) -> None:
    module.__dict__.pop("_wq_cache", None)


def _uncache_gathered_weights(model: nn.Module) -> None:
    """FSDP2 refills a high-precision gathered weight in place without bumping the version counter
    FP4Linear's quantized-weight cache keys on: drop that cache before every forward."""
    for m in model.modules():
        if isinstance(m, FP4Linear) and not isinstance(m.weight.data, FP4ShardedWeight):
            m.register_forward_pre_hook(_drop_weight_cache)


def fully_shard_fp4(
    model: nn.Module,
    mesh: Optional[Any] = None,
    *,
    fp4_all_gather: bool = True,
    reshard_after_forward: bool = True,
    mp_policy: Optional[Any] = None,
    block_types: tuple[type, ...] = (),
    stats: Optional[AllGatherStats] = None,
    activation_checkpointing: bool = False,
    grad_format: str = "fp32",
) -> nn.Module:
    """Apply FSDP2 to ``model`` (each ``block_types`` module, then the root), in place.

    Args:
        model: a model whose linear layers were already converted with ``convert_to_fp4``.
        mesh: 1-D ``DeviceMesh`` of the data-parallel ranks (default: all ranks, on the model's device).
        fp4_all_gather: all-gather FP4Linear weights as packed FP4 codes + per-row scales (with a
            one-rank mesh there is nothing to gather: the layers quantize their own whole weights).
        reshard_after_forward: free gathered weights after forward (ZeRO-3); False keeps them to backward.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. ``param_dtype=torch.bfloat16``).
        block_types: module classes sharded as their own FSDP units (default: the model's ``shard_units``,
            LLaMA's ``Block``).
        stats: an :class:`AllGatherStats` to count bytes into (the model's ``fp4_gather_stats``).
        activation_checkpointing: recompute each block in backward (non-reentrant
            ``torch.utils.checkpoint``; parameter names do not change, so checkpoints stay compatible).
        grad_format: gradient reduce-scatter format: ``"fp32"`` (FSDP2's own, in the reduce dtype of
            ``mp_policy``) or ``"e4m3"`` / ``"e5m2"`` (:class:`FP8ReduceScatter`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("fully_shard_fp4 needs torch.distributed initialised (torchrun, or Lightning's "
                           "ModelParallelStrategy) before it is called")
    block_types = block_types or _declared_shard_units(model)
    mesh = mesh if mesh is not None else _default_mesh(model)
    world = mesh.size()
    stats = stats or AllGatherStats()
    if fp4_all_gather and world == 1:
        # One rank holds the whole weight: the all-gather is the identity, FSDP2 skips the collective
        # (its world-size-1 path copies the shard, and takes only one all-gather input per parameter
        # where FP4ShardedWeight has two), and an FP4 gather would save 0 bytes. Each FP4Linear quantizes
        # its whole weight itself, the codes and scales the FP4 all-gather reproduces, and applies DGE
        # from the high-precision weight: the unsharded layer, bit for bit.
        log.info("fully_shard_fp4: one rank, nothing to all-gather; FP4Linear layers quantize their own weights")
        fp4_all_gather = False
    wrapped = _wrap_weights(model, stats, world) if fp4_all_gather else []
    _uncache_gathered_weights(model)
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    units = [m for m in model.modules() if isinstance(m, block_types)]
    for unit in units:
        if activation_checkpointing:
            unit.forward = functools.partial(_checkpointed, unit.forward)
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    # DGE on the reduce-scattered shard: only where a weight is gathered as FP4 codes with DGE on
    sharded_dge = any(hasattr(m, "_sharded_dge") for m in wrapped)
    _install_grad_hooks([*units, model], stats, sharded_dge, grad_format)
    model.fp4_gather_stats = stats
    return model


def _declared_shard_units(model: nn.Module) -> tuple[type, ...]:
    """The module classes ``model`` declares as its FSDP units (``shard_units``, LLaMA's ``Block``)."""
    block_types = tuple(getattr(model, "shard_units", ()))
    if not block_types:
        raise ValueError(f"fully_shard_fp4: pass block_types (the modules to shard as units); "
                         f"{type(model).__name__} declares no shard_units")
    return block_types


def _default_mesh(model: nn.Module):
    """A 1-D mesh of all ranks on the device type of ``model``'s parameters (CPU for a meta-device model)."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = next(model.parameters()).device
    return init_device_mesh(dev.type if dev.type != "meta" else "cpu", (dist.get_world_size(),))


def _install_grad_hooks(units: list[nn.Module], stats: AllGatherStats, sharded_dge: bool, grad_format: str) -> None:
    """On each ``fully_shard``-ed unit: the DGE hook on the reduce-scattered shard (``sharded_dge``) and the
    FP8 reduce-scatter (``grad_format`` other than fp32)."""
    for unit in units:
        hook = _dge_hook(unit, stats) if sharded_dge else None
        if hook is not None:
            unit.set_all_reduce_hook(hook)
        if grad_format != "fp32":
            group = _param_group(unit)
            if group is not None:
                unit.set_custom_reduce_scatter(FP8ReduceScatter(group.fsdp_params, grad_format, stats))
