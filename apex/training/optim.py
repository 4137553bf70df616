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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from apex.errors import CorruptCheckpoint, show

# Optimizer methods that torch wraps in torch._disable_dynamo, which imports torch._dynamo on
# the first call unless the wrapped function already carries the attribute it caches there.
_WRAPPED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _run_wrapped_methods_eagerly() -> None:
    for name in _WRAPPED_METHODS:
        raw = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if raw is not None and getattr(raw, "__dynamo_disable", None) is None:
            setattr(raw, "__dynamo_disable", raw)  # called as it is: eager, not traced


def make(
    kind: str,
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    lr: float,
    eps: float,
    alpha: float = 0.99,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """Adam (``fused``: one kernel for all parameters) or RMSProp; ``params`` may be groups
    with their own lr (Ape-X DDPG's policy and critics)."""
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


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer skips a step on the device (fused Adam's ``found_inf``, as
    torch's GradScaler uses it) without a host synchronisation: on CUDA. (On the CPU reading
    a flag costs nothing, and the extra kernels would.)"""
    return isinstance(optimizer, torch.optim.Adam) and all(
        group.get("fused") and all(p.is_cuda for p in group["params"]) for group in optimizer.param_groups
    )


def guarded_step(
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    parameters: Iterable[torch.nn.Parameter],
    grad_clip: float,
    figures: list[torch.Tensor],
    all_reduce: Callable[[list[torch.nn.Parameter], torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One gradient step of ``loss``, clipped to ``grad_clip``, applied only if the loss, the
    gradient norm and ``figures`` (scalars) are all finite. Returns ``[skipped, *figures,
    grad_norm]`` as one float32 tensor on the device (``skipped`` 1.0 where the step was not
    applied).

    ``all_reduce(parameters, bad)``, for data-parallel learners, averages the gradients over
    every rank and returns whether any rank's ``bad`` flag (a bool tensor) was set, so that
    every rank skips or steps alike. Fused Adam on CUDA skips on the device: no host
    synchronisation at all; otherwise the flag is read on the host first, the one
    synchronisation of a step.
    """
    parameters = list(parameters)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    with torch.no_grad():
        values = torch.stack(figures).float()
        on_device = skips_on_device(optimizer)
        bad: torch.Tensor | None = None
        if on_device or all_reduce is not None:
            bad = ~torch.isfinite(values).all()
            if all_reduce is not None:
                bad = all_reduce(parameters, bad)  # any rank's
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip).float()[None]
        if on_device and bad is not None:  # (bad is always set on the device)
            found_inf = (bad | ~torch.isfinite(grad_norm)).float().reshape(())
            # fused Adam reads found_inf as GradScaler sets it
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # torch's Optimizer type lacks it
            step(optimizer)
            return torch.cat([found_inf[None], values, grad_norm])
        packed = torch.cat([values, grad_norm])
        skipped = (bad is not None and bool(bad)) or not all(math.isfinite(x) for x in packed.tolist())
        if skipped:
            optimizer.zero_grad(set_to_none=True)
        else:
            step(optimizer)
        return torch.cat([packed.new_tensor([float(skipped)]), packed])


def _fresh_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The per-parameter state this optimizer keeps (names, shapes, dtypes), from a throwaway
    copy stepped once on zeros of its parameters' shapes."""
    groups = []
    for group in optimizer.param_groups:
        params = [torch.zeros_like(p, device="cpu", requires_grad=True) for p in group["params"]]
        options = {k: v for k, v in group.items() if k != "params"}
        options.update({k: False for k in ("fused", "foreach", "capturable") if k in options})  # the plain loop
        groups.append({**options, "params": params})
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.RMSprop)):
        raise ValueError(f"unknown optimizer {type(optimizer).__name__}: adam or rmsprop")
    probe = type(optimizer)(groups)
    for group in probe.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    step(probe)
    state: dict[int, dict[str, Any]] = probe.state_dict()["state"]
    return state


def check_state(optimizer: torch.optim.Optimizer, saved: object) -> None:
    """Whether ``saved`` (a checkpoint's ``optimizer.state_dict()``) fits ``optimizer``: each
    parameter's state holds what this optimizer keeps, of its shape and dtype. torch's
    load_state_dict does not check, and fused Adam writes past a moment of the wrong shape (a
    segfault, not an error). CorruptCheckpoint if a tensor does not fit (the file disagrees with
    networks that fit this run's); ValueError if the optimizer differs (another
    learner.optimizer). Whether its tensors are finite, checkpoint/state.py has said already."""

    state = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        raise CorruptCheckpoint("the optimizer's state is not a dict of per-parameter states")
    if not state:
        return  # an optimizer that never stepped
    expected = _fresh_state(optimizer)
    for index, entry in state.items():
        want = expected.get(index) if isinstance(index, int) and not isinstance(index, bool) else None
        if want is None or not isinstance(entry, dict):
            raise CorruptCheckpoint(
                f"optimizer state for parameter {show(index)}, which this model lacks (it has {len(expected)})"
            )
        if entry.keys() != want.keys():
            raise ValueError(
                f"the optimizer state holds {sorted(map(str, entry))}, this run's optimizer keeps {sorted(want)}"
            )
        for key, value in entry.items():
            ref = want[key]
            if not (isinstance(value, torch.Tensor) and value.shape == ref.shape and value.dtype == ref.dtype):
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise CorruptCheckpoint(
                    f"optimizer state {key!r} of parameter {index} is {got}, expected {tuple(ref.shape)} {ref.dtype}"
                )


def load_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Restores a checkpoint's per-parameter state (Adam's moments and step counts), which
    ``check_state`` passed (call it first: torch checks nothing), and keeps ``optimizer``'s own
    hyper-parameters: this run's config (a resume with another apex_dqn.lr takes it; a
    checkpoint's lr, NaN or a string, is never used)."""
    _run_wrapped_methods_eagerly()
    optimizer.load_state_dict({"state": saved["state"], "param_groups": optimizer.state_dict()["param_groups"]})
