"""Cut a model into pipeline stages at chosen CutPoints with ``torch.distributed.pipelining``'s tracer.

The result is plain data (`PipelineGraph`: which values flow from which stage to which) plus the
``GraphModule`` of one stage whose parameters are the model's own tensors.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, fx, nn
from torch.distributed.pipelining import pipeline
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves

from lightning_varuna._torch_private import (
    FakeTensorMode,
    changes_inputs_in_place,
    generated_code_modules,
    has_backward_hooks,
    rename_node,
    take_flat_inputs,
)
from lightning_varuna.cutpoint import CutPoint
from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.tracing import (
    changes_grad_mode,
    kv_cache_configs,
    traceable_torch_modules,
    trainer_reads_refused,
    untraceable_forward_error,
    without_kv_cache,
)

__all__ = [
    "PipelineGraph",
    "Source",
    "TensorMeta",
    "split_into_all_stages",
    "split_into_rank_stages",
    "split_into_stages",
]


@dataclass(frozen=True)
class Source:
    """Where a value comes from: model input leaf ``index`` (``stage is None``) or output ``index`` of ``stage``."""

    stage: int | None
    index: int


@dataclass(frozen=True)
class TensorMeta:
    """A value one stage passes to another; ``needs_grad``: a gradient flows back into it (a floating-point value
    computed from parameters)."""

    shape: torch.Size
    dtype: torch.dtype
    needs_grad: bool = True


@dataclass
class PipelineGraph:
    """How one traced model is cut: identical on every rank, so each stage knows whom it talks to."""

    stage_inputs: list[list[Source]]
    stage_outputs: list[list[TensorMeta]]
    output_sources: list[Source]
    stage_parameters: list[set[str]]
    output_spec: TreeSpec  # how the values of ``output_sources`` make the model's output
    stage_buffers: list[set[str]]  # canonical buffer names used by each stage
    edges: dict[tuple[int, int], list[int]] = field(init=False)

    def __post_init__(self) -> None:
        # (producer, consumer) -> the producer's output indices it sends, in a fixed order.
        edges: dict[tuple[int, int], set[int]] = {}
        last = self.num_stages - 1
        consumers = [(i, src) for i, sources in enumerate(self.stage_inputs) for src in sources]
        consumers += [(last, src) for src in self.output_sources]
        for consumer, src in consumers:
            if src.stage is not None and src.stage != consumer:
                edges.setdefault((src.stage, consumer), set()).add(src.index)
        self.edges = {key: sorted(values) for key, values in sorted(edges.items())}

    @property
    def num_stages(self) -> int:
        return len(self.stage_inputs)

    def last_reads(self) -> dict[Source, int]:
        """The last stage that reads each value; ``num_stages`` for a value of the model's output. A value no stage
        reads is left out."""
        last = {src: stage for stage, sources in enumerate(self.stage_inputs) for src in sources}
        return {**last, **dict.fromkeys(self.output_sources, self.num_stages)}

    def sends(self, stage: int) -> dict[int, list[int]]:
        """Consumer stage -> output indices that ``stage`` sends to it."""
        return {c: v for (p, c), v in self.edges.items() if p == stage}

    def receives(self, stage: int) -> dict[int, list[int]]:
        """Producer stage -> its output indices that ``stage`` receives."""
        return {p: v for (p, c), v in self.edges.items() if c == stage}


def _activate(module: nn.Module, boundaries: Sequence[str]) -> list[CutPoint]:
    cuts = [module.get_submodule(name) for name in boundaries]
    assert all(isinstance(cut, CutPoint) for cut in cuts)
    for cut in cuts:
        cut._is_stage_boundary = True  # type: ignore[assignment]
    return cuts  # type: ignore[return-value]  # checked above


def _source_of(node: Any, stage_of: dict[fx.Node, int], placeholders: list[fx.Node]) -> Source:
    if not isinstance(node, fx.Node):
        raise TypeError(f"A pipeline stage boundary carries a constant `{node!r}`; only tensors can cross stages.")
    if node.op == "placeholder":
        return Source(None, placeholders.index(node))
    if node.op == "call_module":
        return Source(stage_of[node], 0)
    if node.op == "call_function" and node.target is operator.getitem:
        producer, index = node.args[0], node.args[1]
        assert isinstance(producer, fx.Node) and isinstance(index, int)
        return Source(stage_of[producer], index)
    raise TypeError(f"Unexpected node `{node.format_node()}` between pipeline stages.")


def _returned(graph: Any) -> tuple:
    """The values an FX graph returns (nodes, or constants)."""
    assert isinstance(graph, fx.Graph)
    values = next(n for n in graph.nodes if n.op == "output").args[0]
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


def _output_metas(stage_module: nn.Module, stage: int, needs_grad: list[bool]) -> list[TensorMeta]:
    metas: list[TensorMeta] = []
    for value in _returned(stage_module.graph):
        fake = value.meta.get("val") if isinstance(value, fx.Node) else value
        if not isinstance(fake, Tensor):
            raise TypeError(
                f"Stage {stage} passes a `{type(fake).__name__}` to a later stage; only tensors can cross "
                "stages. Compute that value from tensors inside the stage that uses it."
            )
        differentiable = fake.dtype.is_floating_point or fake.dtype.is_complex
        metas.append(TensorMeta(fake.shape, fake.dtype, differentiable and needs_grad[len(metas)]))
    return metas


def _outputs_needing_gradients(stage_modules: list[nn.Module], stage_inputs: list[list[Source]], inputs: list) -> list:
    """Which outputs of each stage a gradient flows back into: those computed from a floating-point parameter (any:
    a callback may unfreeze a frozen one) by differentiable operations. An attention mask made from the inputs needs
    none: giving it one would send its gradient back and make attention choose another kernel. Found by running the
    stages on fake tensors (no computation, no memory)."""
    frozen = [p for m in stage_modules for p in m.parameters() if p.is_floating_point() and not p.requires_grad]
    outputs: list[tuple] = []
    try:
        for p in frozen:
            p.requires_grad_(True)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.enable_grad():
            values = [mode.from_tensor(leaf) if isinstance(leaf, Tensor) else leaf for leaf in inputs]
            for stage_module, sources in zip(stage_modules, stage_inputs):
                args = [values[src.index] if src.stage is None else outputs[src.stage][src.index] for src in sources]
                out = stage_module(*args)
                outputs.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
    except Exception:  # noqa: BLE001 - shapes fake tensors cannot know (`x[mask]`, `nonzero`): every value may need one
        return [[True] * len(_returned(m.graph)) for m in stage_modules]
    finally:
        for p in frozen:
            p.requires_grad_(False)
    return [[isinstance(value, Tensor) and value.requires_grad for value in out] for out in outputs]


def _bind_real_tensors(stage_module: nn.Module, skeleton: ModelSkeleton, real: dict[str, Tensor]) -> None:
    """Put the model's real parameters and buffers where the stage reads them: its registered ones, and the plain
    attributes through which torch.export's unflattened modules read a buffer of a module the model holds under
    two names (a stem also held as ``self.backbone``), which held the stand-ins the model was traced with: those
    become registered buffers, which a replayed forward swaps for copies as it does the others."""
    for name, _ in list(stage_module.named_parameters(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        stage_module.get_submodule(owner)._parameters[attr] = real[skeleton.canonical(name)]  # type: ignore[assignment]
    for name, _ in list(stage_module.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        canonical = skeleton.canonical(name)
        if canonical in real:
            stage_module.get_submodule(owner)._buffers[attr] = real[canonical]
    for owner_name, owner in stage_module.named_modules(remove_duplicate=False):
        for attr, value in list(vars(owner).items()):
            canonical = skeleton.canonical(f"{owner_name}.{attr}" if owner_name else attr)
            if isinstance(value, Tensor) and canonical in real:
                del owner.__dict__[attr]
                owner.register_buffer(attr, real[canonical])


# Names a node of a generated forward must not take: its first parameter. (FX already avoids keywords and builtins.)
_RESERVED_NAMES = frozenset({"self"})


def _make_generated_code_safe(stage_module: nn.Module) -> None:
    """Make the generated code of each submodule of a stage run what was traced, whatever the strides at run time:

    * rename graph values whose names shadow the generated forward's ``self``. A value is named after the submodule
      that computed it: Hugging Face BERT's attention has a submodule called ``self``, whose output would otherwise
      rebind ``self`` in the middle of the generated ``forward``;
    * reshape where the graph views (unless the view or its base is changed in place). An operation's output may
      have other strides at run time than while tracing (attention's, once its inputs require gradients), and
      torch.export drops a ``.contiguous()`` that was a no-op while tracing (seen with torch 2.11 in
      ``nn.MultiheadAttention``): a view of the output would then fail. A reshape is that view wherever one is
      possible, and a copy elsewhere;
    * cast without first asserting the dtype cast from. The model is traced in its own dtype, autocast off, and
      torch.export asserts a value's dtype before a ``.to(dtype)`` (``.float()``) that was a no-op then: under
      autocast the value has another dtype there (Hugging Face's loss takes ``logits.float()``), the assertion would
      fail, and the cast does what it does on one device (`_dtype_casts_unchecked`; in the stage's own graph too).
    """
    for module in stage_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph) or "graph_module" not in module.__dict__:
            continue
        clashing = [node for node in graph.nodes if node.name in _RESERVED_NAMES]
        for node in clashing:
            rename_node(node, f"{node.name}_")
        views = [
            node
            for node in graph.nodes
            if node.target is torch.ops.aten.view.default and not _changed_in_place(node, node.args[0])
        ]
        for node in views:
            node.target = torch.ops.aten.reshape.default
        casts = _dtype_casts_unchecked(graph)
        if clashing or views or casts:
            module.__dict__["graph_module"] = fx.GraphModule(module, graph)
    if isinstance(stage_module, fx.GraphModule) and _dtype_casts_unchecked(stage_module.graph):  # the stage's own
        stage_module.recompile()


def _dtype_casts_unchecked(graph: fx.Graph) -> int:
    """Drop from ``graph`` the assertion of a value's dtype that torch.export puts before a cast to that dtype
    (``aten.to.dtype``) which was a no-op while tracing; how many there were. Other assertions are kept (a
    ``.to(device)`` is traced as a cast to the dtype it saw, which one device would not make under autocast)."""
    asserts = [
        node
        for node in graph.nodes
        if node.target is torch.ops.aten._assert_tensor_metadata.default
        and node.next.target is torch.ops.aten.to.dtype
        and node.next.args[0] is node.args[0]
        and node.next.args[1] == node.kwargs.get("dtype")
    ]
    for node in asserts:
        graph.erase_node(node)
    return len(asserts)


def _changed_in_place(*nodes: object) -> bool:
    """Whether an operation of the graph changes any of ``nodes``' values in place."""
    return any(
        changes_inputs_in_place(user.target) for node in nodes if isinstance(node, fx.Node) for user in node.users
    )


def split_into_stages(
    module: nn.Module,
    skeleton: ModelSkeleton,
    real_tensors: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    boundaries: Sequence[str],
    stage_index: int,
) -> tuple[PipelineGraph, nn.Module]:
    """Trace ``module(*args, **kwargs)``, cut it before each CutPoint named in ``boundaries``, and return the graph
    and the module of stage ``stage_index``, bound to ``real_tensors``.

    Args:
        module: the whole model; slots of other stages may be empty (the skeleton fills them while tracing).
        skeleton: names, shapes and ties of all the model's tensors.
        real_tensors: canonical FQN -> tensor, for at least the parameters and buffers of ``stage_index``.
        args: example positional inputs of one micro-batch.
        kwargs: example keyword inputs of one micro-batch.
        boundaries: names of the cutpoints where stages 1, 2, ... begin.
        stage_index: the stage whose module (``torch.export.unflatten``'s, running generated code) to return.
    """
    graph, stage_modules = _split(module, skeleton, args, kwargs, boundaries)
    return graph, _bound(stage_modules[stage_index], skeleton, real_tensors)


def split_into_rank_stages(
    module: nn.Module,
    skeleton: ModelSkeleton,
    real_tensors: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    boundaries: Sequence[str],
    stage_indices: Sequence[int],
) -> tuple[PipelineGraph, dict[int, nn.Module]]:
    """`split_into_stages`, returning the module of each stage in ``stage_indices`` (the stages one rank runs, several
    under an interleaved schedule), each bound to ``real_tensors``: a tensor that two of them use is one tensor."""
    graph, stage_modules = _split(module, skeleton, args, kwargs, boundaries)
    return graph, {s: _bound(stage_modules[s], skeleton, real_tensors) for s in stage_indices}


def split_into_all_stages(
    module: nn.Module,
    skeleton: ModelSkeleton,
    real_tensors: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    boundaries: Sequence[str],
) -> tuple[PipelineGraph, list[nn.Module]]:
    """`split_into_stages`, returning the module of every stage, each bound to ``real_tensors`` (all the model's
    tensors: one process runs every stage, as the spilling strategy does)."""
    graph, stage_modules = _split(module, skeleton, args, kwargs, boundaries)
    return graph, [_bound(stage_module, skeleton, real_tensors) for stage_module in stage_modules]


def _split(
    module: nn.Module, skeleton: ModelSkeleton, args: tuple, kwargs: dict, boundaries: Sequence[str]
) -> tuple[PipelineGraph, list[nn.Module]]:
    with _TRACING:
        return _split_traced(module, skeleton, args, kwargs, boundaries)


# torch.export keeps its tracing state (dispatch modes) process-wide: one trace at a time (models of a sweep are
# traced from several threads).
_TRACING = threading.RLock()


def _split_traced(
    module: nn.Module, skeleton: ModelSkeleton, args: tuple, kwargs: dict, boundaries: Sequence[str]
) -> tuple[PipelineGraph, list[nn.Module]]:
    _warn_of_backward_hooks(module)
    cuts = _activate(module, boundaries)
    # The output's structure, as the traced call gives it: a forward may return another one for other arguments (a
    # loss with the logits when given labels, the logits alone without).
    output_specs: list[TreeSpec] = []
    spec_hook = module.register_forward_hook(lambda _, __, output: output_specs.append(tree_flatten(output)[1]))
    try:
        # `generated_code_modules`: the stage's submodules run their generated Python code instead of stepping
        # through the graph with torch.fx.Interpreter, which costs as much again as the forward of a small model.
        with (
            skeleton.stand_ins(module),
            torch.autocast(args_device_type(args), enabled=False),
            generated_code_modules(),
            traceable_torch_modules(),
            without_kv_cache(kv_cache_configs(module)),
            trainer_reads_refused(module),
        ):
            try:
                pipe = pipeline(module, mb_args=args, mb_kwargs=kwargs or None)
            except (RuntimeError, AssertionError) as error:  # torch 2.11 fails a grad-mode block with an assert
                raise untraceable_forward_error(module, error, changes_grad_mode(module, args, kwargs)) from error
    finally:
        spec_hook.remove()
        for cut in cuts:
            cut._is_stage_boundary = False

    graph = pipe.split_gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    num_leaves = len(tree_leaves((args, kwargs)))
    if len(placeholders) != num_leaves:
        raise TypeError(
            f"The traced model takes {len(placeholders)} inputs but the forward call passed {num_leaves} values; "
            "pass tensors (not Python numbers or None) as the forward's arguments."
        )
    stage_nodes = [n for n in graph.nodes if n.op == "call_module"]
    stage_of = {node: k for k, node in enumerate(stage_nodes)}
    stage_modules = [_runnable(pipe.split_gm.get_submodule(node.target)) for node in stage_nodes]
    stage_inputs = [[_source_of(a, stage_of, placeholders) for a in node.args] for node in stage_nodes]
    _check_every_stage_input_is_fed(module, stage_modules, stage_inputs)
    _check_every_call_is_fed(module, stage_modules, args, kwargs)
    needs_grad = _outputs_needing_gradients(stage_modules, stage_inputs, tree_leaves((args, kwargs)))

    pipeline_graph = PipelineGraph(
        stage_inputs=stage_inputs,
        stage_outputs=[_output_metas(m, k, needs_grad[k]) for k, m in enumerate(stage_modules)],
        output_sources=[_source_of(a, stage_of, placeholders) for a in _returned(graph)],
        stage_parameters=[
            {skeleton.canonical(name) for name, _ in m.named_parameters(remove_duplicate=False)} for m in stage_modules
        ],
        output_spec=output_specs[-1],
        stage_buffers=[
            {skeleton.canonical(name) for name, _ in m.named_buffers(remove_duplicate=False)} for m in stage_modules
        ],
    )
    if pipeline_graph.num_stages != len(boundaries) + 1:
        merged = ValueError(
            f"Cutting at CutPoint(s) {list(boundaries)} gave {pipeline_graph.num_stages} stage(s) instead of "
            f"{len(boundaries) + 1}: some stage has no computation (a CutPoint at the forward's input, or two with "
            "nothing between them). Put work before the first CutPoint and between consecutive ones."
        )
        if changes_grad_mode(module, args, kwargs):  # CutPoints inside a reentrant checkpoint: its stages merge
            raise untraceable_forward_error(module, merged, grad_mode_changed=True) from merged
        raise merged
    return pipeline_graph, stage_modules


def _check_every_stage_input_is_fed(
    module: nn.Module, stage_modules: list[nn.Module], stage_inputs: list[list[Source]]
) -> None:
    """torch's pipeline split makes a buffer of the model itself that its forward changes in place an input of the
    stage, which no earlier stage gives it."""
    for stage_module, inputs in zip(stage_modules, stage_inputs):
        assert isinstance(stage_module.graph, fx.Graph)
        unfed = [n.name for n in stage_module.graph.nodes if n.op == "placeholder"][len(inputs) :]
        if unfed:
            raise TypeError(
                f"Cannot cut `{type(module).__name__}.forward` into pipeline stages: it changes a buffer of the model "
                f"itself in place (`{unfed[0]}` in the trace, as `self.mean.copy_(...)` makes), which torch's pipeline "
                "split does not carry into its stage. Keep the buffer in a submodule that updates it in its own "
                "forward, as BatchNorm does."
            )


def _check_every_call_is_fed(module: nn.Module, stage_modules: list[nn.Module], args: tuple, kwargs: dict) -> None:
    """torch's pipeline split drops the subgraph of a grad-mode block that is not in the model's own forward but in a
    submodule's (a parametrization computing under ``no_grad``, as ``spectral_norm``'s power iteration): the
    stage then calls that submodule with fewer inputs than it takes, and would fail at its first run."""
    for stage_module in stage_modules:
        starved = _first_starved_call(stage_module, "")
        if starved:
            error = RuntimeError(f"the traced stage calls `{starved}` without some of its inputs")
            raise untraceable_forward_error(module, error, changes_grad_mode(module, args, kwargs))


def _first_starved_call(graph_module: nn.Module, prefix: str) -> str | None:
    """The name of the first submodule that ``graph_module``'s graph (or a nested one) calls with fewer inputs than
    its graph takes."""
    graph = getattr(graph_module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return None
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        called = graph_module.get_submodule(node.target)
        name = f"{prefix}{node.target}"
        called_graph = getattr(called, "graph", None)
        if isinstance(called_graph, fx.Graph):
            required = [n for n in called_graph.nodes if n.op == "placeholder" and not n.args]
            if len(node.args) + len(node.kwargs) < len(required):
                return name
        starved = _first_starved_call(called, f"{name}.")
        if starved:
            return starved
    return None


def _warn_of_backward_hooks(module: nn.Module) -> None:
    """The stages keep the tensor operations of the forward as traced: its modules' forward hooks run into them,
    but backward hooks are lost."""
    hooked = [name or "the model" for name, m in module.named_modules() if has_backward_hooks(m)]
    if hooked:
        rank_zero_warn(
            f"The backward hooks of {', '.join(hooked)} will not run: the model trains as traced stages, which keep "
            "only the forward's tensor operations. Read gradients in `on_before_optimizer_step` instead."
        )


def _runnable(stage_module: nn.Module) -> nn.Module:
    if isinstance(stage_module, fx.GraphModule):
        take_flat_inputs(stage_module)  # a stage is called with the leaves of its inputs
    _make_generated_code_safe(stage_module)
    return stage_module


def _bound(stage_module: nn.Module, skeleton: ModelSkeleton, real_tensors: dict[str, Tensor]) -> nn.Module:
    _bind_real_tensors(stage_module, skeleton, real_tensors)
    return stage_module


def args_device_type(args: Any) -> str:
    """Device type of the first tensor in ``args`` (for autocast)."""
    for leaf in tree_leaves(args):
        if isinstance(leaf, Tensor):
            return leaf.device.type
    return "cpu"
