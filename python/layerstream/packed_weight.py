"""PackedWeight: a frozen bfloat16 Parameter whose only host copy is its losslessly packed bytes.

With ``LAYERSTREAM_HOST_DTYPE=lossless`` a managed layer keeps a frozen bfloat16 weight in the pinned arena
packed exactly (include/layerstream/lossless.h, about 0.75x of its bytes). The Parameter itself then
becomes a PackedWeight (the same Python object: its contents are swapped in place with
``torch.utils.swap_tensors``, so optimizers, hooks and references keep it): a tensor subclass that has the
weight's shape, dtype and device (cpu) but no storage of its own. It holds the arena's packed bytes, and
every operation on it decodes the exact values on demand (the host decoder), runs on the plain tensor and
drops it again:

* reads (``.data``, ``clone()``, ``to()``, arithmetic, ``torch.equal``, ``state_dict()``, ``torch.save``,
  ``copy.deepcopy``): a temporary decoded tensor for that one operation, never kept (saving writes a plain
  tensor; loading it back into a managed model packs it again at the next use);
* ``w.data = w`` (or an alias of it: ``nn.Module._apply`` after a ``to()`` that changed nothing, the
  weight's own dtype or the host): nothing happens, the weight stays packed;
* writes (``copy_``, in-place ops, ``w[...] = v``, writes through ``w.data``): the weight becomes plain
  again, exact, inside the subclass; the managed layer's next use turns the Parameter back into a plain
  one and packs it anew (views taken from it, e.g. ``w.view(-1)``, are views of a temporary: write
  through the weight itself, as above);
* unfreezing (``requires_grad_(True)``): the managed layer's next use makes the Parameter plain again
  (exact) and stores it as it is, as it does for any trainable weight.

Ownership: a PackedWeight and its aliases (``.data``, ``detach()``) share one ``_Packed`` state, which holds
the arena view of the packed bytes (the view's storage holds the arena block), or, once written, the plain
tensor. Nothing here caches decoded values.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map

_ATEN = torch.ops.aten
_native_lock = threading.Lock()
_native_mod = None


def _mm():
    """The native module (imported lazily: it imports this one)."""
    global _native_mod
    if _native_mod is None:
        with _native_lock:
            from . import manager_modules

            _native_mod = manager_modules
    return _native_mod


class _Packed:
    """What a PackedWeight and its aliases share: the packed bytes (an arena view) and their spec, or the
    plain tensor once the weight was written."""

    __slots__ = ("codes", "spec", "shape", "plain", "writes")

    def __init__(self, codes: torch.Tensor, spec: tuple, shape):
        self.codes = codes
        self.spec = spec
        self.shape = tuple(int(s) for s in shape)
        self.plain: torch.Tensor | None = None
        self.writes = 0  # bumped by every write (the managed layer checks it at each use)

    def values(self) -> torch.Tensor:
        """The exact values: the plain tensor once written, else a fresh decode (the caller's to drop)."""
        if self.plain is not None:
            return self.plain
        return _mm()._packed.unpack(self.codes, self.spec, list(self.shape))

    def materialize(self) -> torch.Tensor:
        """Makes the weight plain (for a write): decoded once, kept, and the packed bytes let go."""
        if self.plain is None:
            self.plain = self.values()
            self.codes = None
        return self.plain


def _is_write(func, index: int) -> bool:
    arg = func._schema.arguments[index] if index < len(func._schema.arguments) else None
    return arg is not None and arg.alias_info is not None and arg.alias_info.is_write


class PackedWeight(torch.Tensor):
    """A bfloat16 weight held only as its losslessly packed bytes; see the module docstring."""

    @staticmethod
    def __new__(cls, state: _Packed, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, state.shape, dtype=torch.bfloat16, device=torch.device("cpu"), requires_grad=requires_grad
        )

    def __init__(self, state: _Packed, requires_grad: bool = False):
        self._ls_packed = state

    def __repr__(self) -> str:  # the values, as a plain tensor prints them
        return f"PackedWeight({self._ls_packed.values()!r})"

    def __reduce_ex__(self, protocol):
        # torch.save and pickle store the exact plain values, as a plain tensor (or Parameter) of them
        # (torch.load, weights_only included, gives a plain tensor back).
        plain = self._ls_packed.values().detach()
        if getattr(self, "_is_param", False):
            plain = torch.nn.Parameter(plain, self.requires_grad)
        elif self.requires_grad:
            plain = plain.clone().requires_grad_(True)
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        plain = self._ls_packed.values().clone()
        result = torch.nn.Parameter(plain, self.requires_grad) if getattr(self, "_is_param", False) else plain
        memo[id(self)] = result
        return result

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and args and isinstance(args[0], PackedWeight):
            # w[...] = v: a write into the weight (its slice would otherwise be a view of a temporary).
            target = args[0]
            state = target._ls_packed
            with torch._C.DisableTorchFunctionSubclass():
                plain = state.materialize()
                rest = tree_map(_unwrap, args[1:])
                plain.__setitem__(*rest)
            state.writes += 1
            return None
        if _is_data_setter(func) and args and isinstance(args[0], PackedWeight):
            # w.data = v (nn.Module._apply moving it, a loader): the object takes v's metadata as a plain
            # tensor would (set_data), and from now on its values are v's.
            target, value = args[0], args[1]
            if isinstance(value, PackedWeight) and value._ls_packed is target._ls_packed:
                # Its own bytes again: a to() that changed nothing (the weight's dtype, the host), after which
                # _apply assigns the result to .data (AI-Toolkit moves its models so around every sample). It
                # stays packed: nothing to decode, nothing to pack again.
                return None
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)
            state = target._ls_packed
            state.plain = value._ls_packed.values() if isinstance(value, PackedWeight) else value.detach()
            state.codes = None
            state.shape = tuple(state.plain.shape)
            state.writes += 1
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (_ATEN.detach.default, _ATEN.alias.default) and isinstance(args[0], PackedWeight):
            return PackedWeight(args[0]._ls_packed)  # .data, detach(): an alias of the same weight
        if func is _ATEN.is_pinned.default and isinstance(args[0], PackedWeight):
            # Its bytes are in layerstream's arena (pinned host memory where the device is CUDA): code that
            # copies pinned weights out of the arena (AI-Toolkit's detach) copies this one (plain, exact).
            return args[0]._ls_packed.plain is None
        if func is _ATEN._to_copy.default and isinstance(args[0], PackedWeight):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":  # to("meta"): no decode needed
                dtype = kwargs.get("dtype") or torch.bfloat16
                return torch.empty(args[0]._ls_packed.shape, dtype=dtype, device="meta")
        if (func is _ATEN.copy_.default and isinstance(args[0], PackedWeight) and args[0]._ls_packed.plain is None
                and isinstance(args[1], torch.Tensor) and not isinstance(args[1], PackedWeight)
                and tuple(args[1].shape) == args[0]._ls_packed.shape):
            # Overwritten whole (load_state_dict): nothing to decode first.
            state = args[0]._ls_packed
            state.plain = torch.empty(state.shape, dtype=torch.bfloat16)
            state.codes = None
        # Writes: the weight becomes plain (exact), and the op runs on it.
        written: list[_Packed] = []
        flat = list(args)
        for i, a in enumerate(flat):
            if isinstance(a, PackedWeight) and _is_write(func, i):
                written.append(a._ls_packed)
                flat[i] = a._ls_packed.materialize()
        for name, a in list(kwargs.items()):
            if isinstance(a, PackedWeight):
                arg = next((x for x in func._schema.arguments if x.name == name), None)
                if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
                    written.append(a._ls_packed)
                    kwargs[name] = a._ls_packed.materialize()
        flat = tree_map(_unwrap, flat)
        kwargs = tree_map(_unwrap, kwargs)
        out = func(*flat, **kwargs)
        for state in written:
            state.writes += 1
        if written:
            # An in-place op returns its first argument: give back the PackedWeight, not its inside.
            originals = {id(a._ls_packed.plain): a for a in args if isinstance(a, PackedWeight)}
            return tree_map(lambda t: originals.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        return out


def _is_data_setter(func) -> bool:
    return getattr(func, "__name__", "") == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data


def _unwrap(a: Any) -> Any:
    return a._ls_packed.values() if isinstance(a, PackedWeight) else a


def is_packed(t: Any) -> bool:
    return isinstance(t, PackedWeight)


def _swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """torch.utils.swap_tensors (t1 and t2 of different classes), also for a frozen leaf that a finished
    graph's gradient accumulator still holds (a weight trained, then frozen): swap_tensors accepts that
    holder only for a tensor that requires grad (it then makes the accumulator refuse any later use), so the
    leaf requires grad for the swap. A swap refused at its last check (a C++ weak reference to a TensorImpl:
    another managed layer holds the Parameter) has already exchanged the classes and attributes: they are
    put back before the error is raised."""
    cls1, cls2 = type(t1), type(t2)
    frozen = t1.is_leaf and not t1.requires_grad and t1._use_count() == 2
    keep = t2.requires_grad
    if frozen:
        t1.requires_grad_(True)
        t2.requires_grad_(True)
    try:
        torch.utils.swap_tensors(t1, t2)
    except RuntimeError:
        if type(t1) is cls2 and type(t2) is cls1:  # half done: classes and __dict__ exchanged, not the data
            t1.__class__, t2.__class__ = cls1, cls2
            d1, d2 = t1.__dict__, t2.__dict__
            t1.__dict__, t2.__dict__ = d2, d1
        raise
    finally:
        if frozen:
            t1.requires_grad_(keep)
            t2.requires_grad_(False)


def wrap(param: torch.Tensor, codes: torch.Tensor, spec: tuple, shape) -> bool:
    """Turns `param` (a plain bfloat16 tensor or Parameter, the same object afterwards) into a PackedWeight
    of `codes` (the arena view of its packed bytes; decoded, they are its exact values). Called by the
    managed layer (module.cc) once it holds the weight packed. False when the object cannot be swapped in
    place (a weak reference to it, or another holder of its TensorImpl): it then keeps its plain values."""
    if weakref.getweakrefcount(param) != 0:
        return False
    new = PackedWeight(_Packed(codes, spec, shape), requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    if isinstance(param, torch.nn.Parameter):
        new._is_param = True
    try:
        _swap(param, new)
    except RuntimeError:
        return False
    return True


def unwrap(weight: PackedWeight) -> None:
    """Turns a PackedWeight back into a plain tensor (or Parameter) of its exact values, in place (the same
    object): for a weight unfrozen or written since it was packed (module.cc, before the layer's use)."""
    plain = weight._ls_packed.values()  # the state is left as it is: a refused swap changes nothing
    is_param = getattr(weight, "_is_param", False)
    if is_param:
        new = torch.nn.Parameter(plain, requires_grad=weight.requires_grad)
    else:
        new = plain.detach().requires_grad_(weight.requires_grad)
    attrs = dict(weight.__dict__)
    attrs.pop("_ls_packed", None)
    attrs.pop("_is_param", None)
    new.__dict__.update(attrs)
    try:
        _swap(weight, new)
    except RuntimeError as exc:
        raise RuntimeError(
            "layerstream: a losslessly packed weight (LAYERSTREAM_HOST_DTYPE=lossless) was unfrozen or written, "
            "and its Parameter could not be turned back into a plain tensor in place (something else holds it: "
            f"{exc}). Drop other references to the Parameter (a weak reference, a saved graph) before its next use"
        ) from exc
