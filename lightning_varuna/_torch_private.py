"""The private torch APIs lightning-varuna relies on, all in one place (verified with torch 2.13).

None has a public equivalent. If a torch release moves or changes one, this is the file to change; the tests that
exercise each are named below.
"""

from __future__ import annotations

import sys

import torch

# The module whose `_canonical_mask` `nn.MultiheadAttention` passes its masks through: `partition.tracing` wraps it
# while a model is traced, so that a float mask meets attention in the queries' dtype. tests/test_partition.py.
import torch.nn.functional as functional_module

# The module of nn.Transformer and its encoder and decoder, whose `_detect_is_causal_mask` compares a mask's values
# (a data-dependent guard torch.export cannot trace): `partition.tracing` replaces it while a model is traced.
# tests/test_real_models.py.
import torch.nn.modules.transformer as transformer_module
from torch import Tensor, fx, nn

# Tensors with shapes and no data, through which autograd still runs: which values crossing pipeline stages a
# gradient flows into, found by running the stages on them at the trace (`partition.split`). tests/test_partition.py.
from torch._subclasses.fake_tensor import FakeTensorMode

# One flat buffer from many gradients and views of it back: the gradient all-reduce of each step.
# tests/test_parity.py.
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors

# The slice of a saved tensor that a DCP read item asks for (what DCP's own readers call): `RangeReader`.
# tests/test_checkpoint_storage.py.
from torch.distributed._shard._utils import narrow_tensor_by_index

# DCP's reader and writer for fsspec URLs (s3://, az://, gs://, memory://, local paths): checkpoints on object
# stores. tests/test_checkpoint_storage.py, tests/test_checkpoint_resume.py.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# The default process group's key-value store (TCPStore, or torchrun's): where a failing rank leaves its error for
# the others. tests/test_failures.py.
from torch.distributed.distributed_c10d import _get_default_store as default_store

# The state of torch.distributed in this process (its default process group): a worker forked from a process that
# holds a group (an earlier VarunaStrategy or DDP run in it) inherits that group, whose collectives would wait on the
# parent's connections forever (torchmetrics syncs a metric whenever a group is initialized), and destroying it there
# hangs too: the worker drops its reference instead (`multimodel.processes`). tests/test_multi_model.py (processes).
from torch.distributed.distributed_c10d import _world as distributed_state

# torch's backward in two parts, what its zero-bubble schedules run: the gradients of a stage's inputs (keeping the
# autograd graph, with the gradients reaching each parameter group's intermediate nodes) and, later, the parameters'
# from those nodes; and the graph walks the first part splits the graph with (`construct_reverse_graph`,
# `reverse_closure`), with which `pipeline.split_backward` checks that every path to a parameter passes the split.
# tests/test_split_backward.py, tests/test_parity.py (zero-bubble).
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc as grad_node
from torch.distributed.pipelining._backward import (
    construct_reverse_graph,
    reverse_closure,
    stage_backward_input,
    stage_backward_weight,
)

# Makes `torch.export.unflatten` build modules that run FX's generated Python code instead of stepping through
# their graphs with `torch.fx.Interpreter` (about 1.6x faster stage forwards). tests/test_partition.py.
from torch.export.unflatten import _disable_interpreter as generated_code_modules

# Renames a value of an FX graph (keeping names unique) when its name would shadow `self` in the generated code of a
# stage's submodule (Hugging Face BERT's `attention.self`). tests/test_real_models.py.
from torch.fx.graph import _PyTreeCodeGen
from torch.fx.node import Node

# The base of BatchNorm1d/2d/3d, their lazy forms and SyncBatchNorm: the normalizations over the batch's rows, which
# a micro-batch of one row (and one value per channel) cannot train. tests/test_microbatch.py.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNorm

# The base of BatchNorm and InstanceNorm, whose running statistics each data-parallel replica updates from its own
# micro-batches: VarunaStrategy gives every replica the first one's after each step. tests/test_real_models.py.
from torch.nn.modules.batchnorm import _NormBase as NormWithRunningStats

rename_node = Node._rename

# The operation of `GradScaler.unscale_`: unscales gradients in place and flags an inf or NaN among them. A spilled
# model runs it on each shard's gradients while they are on the device (`spilling.grad_scaler`, whose GradScaler
# subclass also extends `_unscale_grads_` and reads `_scale`, as torch's own ShardedGradScaler does).
# tests/test_spilling_precision.py (fp16), tests/test_spilling_cuda.py.
unscale_and_find_inf = torch._amp_foreach_non_finite_check_and_unscale_

# Each tensor's norm, in one call: how `torch.nn.utils.get_total_norm` takes the gradients' norms before it combines
# them (on the CPU too, where it loops over `vector_norm`, with the same values). A spilled model keeps each shard's
# for clipping by the norm over all shards. tests/test_spilling_precision.py (fp16, with clipping).
foreach_norm = torch._foreach_norm


def has_backward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself has backward (or backward pre-) hooks, which a traced stage does not run; torch has
    no public way to ask. tests/test_partition.py."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


def changes_inputs_in_place(target: object) -> bool:
    """Whether the target of an FX node is an ATen operation that changes an input in place (its schema says so;
    torch has no public way to ask). tests/test_spilling_real_models.py (torch 2.11)."""
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def take_flat_inputs(graph_module: fx.GraphModule) -> None:
    """Make ``graph_module``'s forward take the leaves of its inputs: torch's pipeline split can leave the model's
    pytree input spec (a dict batch) on a stage with one input placeholder, whose forward then expects the whole
    structure. FX's codegen has no public setter. tests/test_spilling_like_one_device.py (a dict batch)."""
    if isinstance(graph_module.graph._codegen, _PyTreeCodeGen):
        graph_module.graph._codegen = fx.graph.CodeGen()
        graph_module.recompile()


def register_cuda_device_guard() -> None:
    """Register torch's stand-in CUDA device guard now, from the calling thread. Without a GPU, torch.export's fake
    tensors register it when first used; with torch 2.11's CUDA build on a machine without a GPU, a sweep whose
    models' threads did so first crashed (a segmentation fault in `FakeTensorMode.__enter__`).
    tests/test_multi_model.py (seen with torch 2.11)."""
    torch._C._ensureCUDADeviceGuardSet()


def storage_users(tensor: Tensor) -> int:
    """How many hold ``tensor``'s memory, ``tensor`` included: tensors and views of it (the C++ references to its
    storage) and its Python storage object where someone keeps one (``t.untyped_storage()``). Counted against a new
    tensor's, which has one. The disk tier reads into a buffer again once nothing else holds it.
    tests/test_spill_store.py."""
    return _storage_references(tensor) - _storage_references(torch.empty(1)) + 1


def _storage_references(tensor: Tensor) -> int:
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) + sys.getrefcount(storage)


__all__ = [
    "BatchNorm",
    "FakeTensorMode",
    "FsspecReader",
    "NormWithRunningStats",
    "FsspecWriter",
    "changes_inputs_in_place",
    "construct_reverse_graph",
    "default_store",
    "distributed_state",
    "flatten_dense_tensors",
    "foreach_norm",
    "functional_module",
    "generated_code_modules",
    "grad_node",
    "has_backward_hooks",
    "narrow_tensor_by_index",
    "register_cuda_device_guard",
    "rename_node",
    "reverse_closure",
    "stage_backward_input",
    "stage_backward_weight",
    "storage_users",
    "take_flat_inputs",
    "transformer_module",
    "unflatten_dense_tensors",
    "unscale_and_find_inf",
]
