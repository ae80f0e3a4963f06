"""What ``torch.export`` needs to trace the models users bring, and the error that names a line it cannot trace."""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from lightning_varuna._torch_private import functional_module, transformer_module

__all__ = [
    "changes_grad_mode",
    "kv_cache_configs",
    "traceable_torch_modules",
    "trainer_reads_refused",
    "untraceable_forward_error",
    "without_kv_cache",
]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn") + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # lightning_varuna/
_LIGHTNING_DIR = os.path.dirname(os.path.dirname(pl.__file__)) + os.sep
_MODULE_CALL = nn.Module.__call__.__code__.co_filename  # `Module.__call__` machinery between the model's frames
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _is_causal_as_given(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


def _in_attention_dtype(canonical_mask: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    """``nn.MultiheadAttention``'s mask conversion, which also widens a float mask to the queries' dtype."""

    def canonical(
        mask: torch.Tensor | None,
        mask_name: str,
        other_type: torch.dtype | None,
        other_name: str,
        target_type: torch.dtype,
        check_other: bool = True,
    ) -> torch.Tensor | None:
        mask = canonical_mask(mask, mask_name, other_type, other_name, target_type, check_other)
        if mask is not None and mask.is_floating_point() and mask.dtype.itemsize < target_type.itemsize:
            return mask.to(target_type)
        return mask

    return canonical


@contextmanager
def traceable_torch_modules() -> Iterator[None]:
    """Make ``nn.Transformer``, ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` traceable.

    Given a mask and no ``is_causal``, they compare the mask's values with a causal mask to decide whether attention
    may take its causal shortcut: a guard on data that ``torch.export`` cannot trace. While tracing, the mask is
    simply applied as given (``is_causal`` stays what the caller said): the same attention, computed from the mask.
    A float mask narrower than the queries (``generate_square_subsequent_mask``'s float32 in a float64 model) is
    widened to their dtype, which is exact: torch's CPU attention kernel misreads such a mask (seen with torch 2.13:
    wrong outputs, no error), where the causal shortcut it replaces takes no mask at all.
    """
    detect = transformer_module._detect_is_causal_mask
    canonical_mask = functional_module._canonical_mask
    transformer_module._detect_is_causal_mask = _is_causal_as_given
    functional_module._canonical_mask = _in_attention_dtype(canonical_mask)
    try:
        yield
    finally:
        transformer_module._detect_is_causal_mask = detect
        functional_module._canonical_mask = canonical_mask


def kv_cache_configs(module: nn.Module) -> list[Any]:
    """The Hugging Face configs (``config.use_cache``) of ``module``'s submodules, each once."""
    configs = {id(c): c for m in module.modules() if hasattr(c := getattr(m, "config", None), "use_cache")}
    return list(configs.values())


@contextmanager
def without_kv_cache(configs: list[Any]) -> Iterator[None]:
    """Run the Hugging Face models of ``configs`` (`kv_cache_configs`) in the block with ``use_cache = False``.

    By default a Hugging Face language model returns its attention's key/value cache (for generation): an object
    torch.export cannot return, holding every layer's keys and values, which stages would pass on. Training never
    reads it; the loss and logits are the same without it.
    """
    caching = [config for config in configs if config.use_cache is True]
    for config in caching:
        config.use_cache = False
    try:
        yield
    finally:
        for config in caching:
            config.use_cache = True


# The Trainer's attributes that stay as they are for a whole fit and are the same in every process (its set-up and
# configuration): a traced value of one is still right at every step. Not the ranks: a pipelined forward runs in
# several processes.
_FIXED_FOR_A_FIT = frozenset(
    {
        "accelerator",
        "default_root_dir",
        "gradient_clip_algorithm",
        "gradient_clip_val",
        "max_epochs",
        "max_steps",
        "num_devices",
        "num_nodes",
        "precision",
        "world_size",
    }
)


class _ReadsRecorded:
    """Stands for the Trainer while a forward is traced, noting each read of an attribute that changes during a fit
    and the model's line reading it."""

    def __init__(self, trainer: pl.Trainer, reads: dict[str, str]) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        if name in _FIXED_FOR_A_FIT:
            return getattr(self._trainer, name)
        outside = (_TORCH_DIR, _LIGHTNING_DIR, _OWN_DIR, "<")
        lines = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(outside)]
        self._reads.setdefault(name, _describe(lines[-1]) if lines else "the forward")
        return getattr(self._trainer, name)


@contextmanager
def trainer_reads_refused(module: nn.Module) -> Iterator[None]:
    """Refuse a forward that reads the Trainer's state (``self.global_step``, ``self.current_epoch``,
    ``self.trainer...``) once traced: the cut model runs the operations traced at set-up, in which such a value
    stays what it was then (a branch on it would never be taken again)."""
    if not isinstance(module, pl.LightningModule) or module._trainer is None:
        yield
        return
    trainer = module._trainer
    reads: dict[str, str] = {}
    module._trainer = _ReadsRecorded(trainer, reads)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._trainer = trainer
    if reads:
        name, where = next(iter(reads.items()))
        raise TypeError(
            f"Cannot cut `{type(module).__name__}.forward` into pipeline stages or shards: it reads the Trainer's "
            f"`{name}` at {where}. A cut model runs the operations traced once at set-up, in which that value stays "
            "what it was then, and a branch on it is never taken again. Read it in `training_step` and pass the "
            "forward what it needs as a tensor argument (`self(x, torch.tensor(float(self.global_step >= 100)))`, "
            "used as `h + flag * f(h)`)."
        )


def changes_grad_mode(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module``'s forward switches the grad mode (a ``torch.no_grad()`` block, a reentrant checkpoint):
    torch.export traces such a block as a subgraph, which torch's pipeline split does not carry over."""
    try:
        exported = torch.export.export(module, args, kwargs)
    except Exception:  # it fails for another reason, which the caller reports
        return False
    return any(node.target is torch.ops.higher_order.wrap_with_set_grad_enabled for node in exported.graph.nodes)


def untraceable_forward_error(module: nn.Module, error: BaseException, grad_mode_changed: bool) -> Exception:
    """The error to raise when tracing ``module``'s forward failed with ``error``: it names the line that failed.

    ``torch.export`` runs the forward as Python, so the failing exception's traceback holds the model's own frames:
    the innermost frame outside torch is the user's line; the innermost in ``torch.nn`` is torch's module code.
    """
    cause = error.__cause__ or error
    frames = _model_frames(cause)
    name = f"`{type(module).__name__}.forward`"
    returned = _UNKNOWN_OUTPUT.search(str(cause))
    if returned:
        return TypeError(
            f"Cannot cut {name} into pipeline stages: it returns a `{returned.group(1).rsplit('.', 1)[-1]}`, which "
            "torch.export cannot trace. A cut model's forward may return tensors and tuples, lists, dicts or "
            "ModelOutputs of them: return what the step needs (e.g. `.logits`, `.loss`)."
        )
    if grad_mode_changed:
        return RuntimeError(
            f"Cannot cut {name} into pipeline stages: it changes the grad mode inside (a `with torch.no_grad():` or "
            "`torch.enable_grad()` block, a reentrant `torch.utils.checkpoint`, or a parametrization computed under "
            "`no_grad`, as `spectral_norm`'s), which torch's pipeline split cannot cut around. Use `.detach()` on "
            "what the block computes instead (`centre = h.mean(0).detach()`), and `use_reentrant=False` for "
            f"checkpoints. ({type(cause).__name__}: {_first_line(cause)})"
        )
    if not frames:
        return RuntimeError(
            f"Cannot cut {name} into pipeline stages: tracing it with torch.export failed "
            f"({type(cause).__name__}: {_first_line(cause)}). See https://pytorch.org/docs/stable/export.html"
        )
    user_frames = [f for f in frames if not f.filename.startswith(_TORCH_DIR)]
    where = _describe(user_frames[-1] if user_frames else frames[-1])
    in_torch = frames[-1] not in user_frames
    if in_torch:
        where += f", inside {_describe(frames[-1])}"
    return RuntimeError(
        f"Cannot cut {name} into pipeline stages: torch.export cannot trace {where}. {_reason(cause, in_torch)}."
    )


def _reason(cause: BaseException, in_torch: bool) -> str:
    """Why the line cannot be traced and what to change; ``in_torch``: the line is torch's module code."""
    if not isinstance(cause, GuardOnDataDependentSymNode):
        return f"{type(cause).__name__}: {_first_line(cause)}"
    reason = (
        "Python code there depends on a tensor's values (`if tensor:`, `bool()`, `int()`, `float()`, `.item()`), "
        "which tracing with example inputs cannot know. "
    )
    if in_torch:
        return reason + (
            "That line is torch's own module code: give it the argument that tells it what it reads from the "
            "values, if it has one (as `is_causal=` does for an attention mask)"
        )
    return reason + (
        "Compute it with tensor operations instead (e.g. `torch.where(condition, a, b)` for `a if condition else b`), "
        "or decide it outside the forward, from shapes or a constructor argument"
    )


def _model_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the traced model's code (the user's and torch.nn's) in ``error``'s traceback, outermost first."""
    return [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(("<", _OWN_DIR))
        and (not f.filename.startswith(_TORCH_DIR) or f.filename.startswith(_TORCH_NN_DIR))
        and f.filename != _MODULE_CALL
    ]


def _describe(frame: traceback.FrameSummary) -> str:
    return f"line {frame.lineno} of {frame.filename} (`{(frame.line or '').strip()}`)"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
