"""Kernel overrides: replace a Triton kernel by qualified name, without editing its module
(seed part 3 §2.3: how a platform swaps core kernels for its own).

`register_kernels({"fleetserve.kernels.rms_norm._rms_norm_kernel": my_kernel})` wraps each
original in a `KernelOverride` and rebinds every reference to it: each module's globals that
hold the original (aliases made by `from mod import kernel` included), the `.kernel` of warmup
owner classes (their cached `_kernel_arg_names` cleared), and last the definition site (the scan
compares by identity, `is`, and never hashes or compares module values, which may be
placeholders that import on access). References captured in closures or containers are not
rebound: register at start-up, before kernels are captured.

A name resolves as `module.attr`, or `module.Class.attr` when the segment before the attribute
starts with a capital letter (a class: a warmup owner). The wrapper keeps the launch syntax
`kernel[grid](*args, **kwargs)`: positional arguments pass through; keyword arguments pass by
name when the override's parameter names equal the original's, and otherwise are put into the
original's parameter order and passed positionally, an unknown keyword raising RuntimeError. An
override is a Triton kernel (`impl[grid](...)`) or a plain callable (called without the grid:
e.g. a torch implementation).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KernelOverride", "register_kernels", "resolve_kernel"]


def _param_names(fn: Any) -> list[str]:
    """A Triton kernel's `arg_names`, else the callable's signature."""
    names = getattr(fn, "arg_names", None)
    if names is not None:
        return list(names)
    return list(inspect.signature(getattr(fn, "fn", fn)).parameters)


class KernelOverride:
    """A launchable standing in for `original`, running `impl`."""

    def __init__(self, original: Any, impl: Any) -> None:
        self.original = original
        self._impl = impl
        self.arg_names = _param_names(original)
        self.constexprs = getattr(original, "constexprs", [])
        self.func = getattr(original, "fn", original)
        """The original Python function (what warmup code introspects)."""
        self._forward_by_name = _param_names(impl) == self.arg_names

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._forward_by_name and kwargs:
            unknown = sorted(set(kwargs) - set(self.arg_names))
            if unknown:
                raise RuntimeError(
                    f"kernel override of {self.func.__name__!r} got keyword(s) {unknown} the "
                    f"original kernel does not take (its parameters: {self.arg_names})"
                )
            ordered = list(args)
            for name in self.arg_names[len(args) :]:
                if name not in kwargs:
                    break
                ordered.append(kwargs.pop(name))
            if kwargs:
                raise RuntimeError(
                    f"kernel override of {self.func.__name__!r}: keyword(s) {sorted(kwargs)} "
                    f"follow a missing parameter and cannot be passed positionally"
                )
            args, kwargs = tuple(ordered), {}
        if hasattr(self._impl, "__getitem__"):
            return self._impl[grid](*args, **kwargs)
        return self._impl(*args, **kwargs)


def resolve_kernel(qualname: str) -> tuple[Any, str]:
    """(owner object, attribute name) of `pkg.mod.kernel` or `pkg.mod.Class.kernel`.

    Raises:
        ValueError: a name without a module part, or an owner that does not import.
    """
    owner_path, _, attr = qualname.rpartition(".")
    if not owner_path or not attr:
        raise ValueError(f"kernel name must be 'module.kernel', got {qualname!r}")
    parent, _, last = owner_path.rpartition(".")
    try:
        if last[:1].isupper() and parent:
            return getattr(importlib.import_module(parent), last), attr
        return importlib.import_module(owner_path), attr
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"kernel {qualname!r} does not resolve: {exc}") from exc


def _rebind(original: Any, wrapper: KernelOverride) -> int:
    """Point every module global and warmup owner holding `original` at `wrapper`."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, wrapper)
                count += 1
            # NOTE: `type(v) is type`, not isinstance: some module values (deprecation shims,
            # lazy placeholders) warn or import when their class or attributes are probed.
            elif type(value) is type and value.__dict__.get("kernel") is original:
                value.kernel = wrapper  # type: ignore[attr-defined]
                if "_kernel_arg_names" in value.__dict__:
                    value._kernel_arg_names = None  # type: ignore[attr-defined]
                count += 1
    return count


def register_kernels(overrides: Mapping[str, Any]) -> dict[str, KernelOverride]:
    """Install each override (name → Triton kernel or callable); returns name → wrapper.

    Raises:
        ValueError: a name that does not resolve.
        RuntimeError: a kernel that is already overridden (register once, at start-up).
    """
    installed: dict[str, KernelOverride] = {}
    for qualname, impl in overrides.items():
        owner, attr = resolve_kernel(qualname)
        original = getattr(owner, attr, None)
        if original is None:
            raise ValueError(f"kernel {qualname!r} does not resolve: no attribute {attr!r}")
        if isinstance(original, KernelOverride):
            raise RuntimeError(f"kernel {qualname!r} is already overridden")
        wrapper = KernelOverride(original, impl)
        _rebind(original, wrapper)
        # NOTE: the definition site last, so that the scan above still saw the original there.
        setattr(owner, attr, wrapper)
        installed[qualname] = wrapper
    return installed
