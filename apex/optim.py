"""The learners' optimizers, made and stepped without importing ``torch._dynamo``.

torch.optim imports ``torch._dynamo`` the first time an optimizer is made or stepped, only
to mark its methods as not to be compiled: 1.2 s of CPU on this project's 2-core machine, a
third of a CartPole run's start-up. apex never compiles, so ``make`` and ``step`` run the
same eager torch code without that import. Where a torch version lays its wrappers out
otherwise, they fall back to the plain calls: as correct, only slower to start.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable

import torch

# Optimizer methods that torch wraps in torch._disable_dynamo, which imports torch._dynamo on
# the first call unless the wrapped function already carries the attribute it caches there.
_WRAPPED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _run_wrapped_methods_eagerly() -> None:
    for name in _WRAPPED_METHODS:
        raw = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if raw is not None and getattr(raw, "__dynamo_disable", None) is None:
            setattr(raw, "__dynamo_disable", raw)  # called as it is: eager, not traced


def make(kind: str, params: Iterable[torch.nn.Parameter], lr: float, eps: float, alpha: float = 0.99,
         fused: bool = False) -> torch.optim.Optimizer:
    """Adam (``fused``: one kernel for all parameters) or RMSProp."""
    _run_wrapped_methods_eagerly()
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=fused)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps)
    raise ValueError(f"unknown optimizer {kind!r}: adam or rmsprop")


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without its wrappers (the profiler hook and the grad-mode switch
    that imports torch._dynamo): the optimizer's own update, under no_grad as torch runs it."""
    update = inspect.unwrap(type(optimizer).step)
    with torch.no_grad():
        update(optimizer)


def guarded_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, parameters: Iterable[torch.nn.Parameter],
                 grad_clip: float, figures: list[torch.Tensor]) -> list[float] | None:
    """One gradient step of ``loss``, clipped to ``grad_clip``, taken only if the loss, the
    gradient norm and ``figures`` are all finite. One host synchronisation reads them all:
    returns ``[*figures, grad_norm]`` as floats, or None when the step was skipped (its
    gradients cleared)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    values = torch.stack([*figures, grad_norm]).cpu().tolist()
    if not all(math.isfinite(x) for x in values):
        optimizer.zero_grad(set_to_none=True)
        return None
    step(optimizer)
    return values
