"""Finding CutPoints, timing segments, the model skeleton and cutting a model into stage GraphModules."""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import DIM, SEQ, VOCAB, TinyLM
from torch import nn
from torch.nn.functional import _canonical_mask as canonical_mask
from torch.nn.modules.transformer import _detect_is_causal_mask as detect_is_causal_mask

import lightning_varuna.partition.split
from lightning_varuna import CutPoint, cut_after
from lightning_varuna._torch_private import transformer_module
from lightning_varuna.partition.discovery import discover_cutpoints
from lightning_varuna.partition.skeleton import ModelSkeleton
from lightning_varuna.partition.split import (
    PipelineGraph,
    Source,
    TensorMeta,
    split_into_all_stages,
    split_into_stages,
)
from lightning_varuna.pipeline.schedules import dry_run, forward_only, gpipe, one_f_one_b
from lightning_varuna.profiling.segments import measure_segments

BATCH = 4
BOUNDARIES = ["cuts.1", "cuts.3"]


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def make_idx() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    out = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    out[:, -1] = 0  # some padding so the mask matters
    return out


@pytest.fixture
def idx() -> torch.Tensor:
    return make_idx()


def real_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def all_cutpoints(module: nn.Module) -> list[CutPoint]:
    return [m for m in module.modules() if isinstance(m, CutPoint)]


# --------------------------------------------------------------------------------------------- discovery


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.cut = CutPoint()

    def forward(self, x):
        return self.cut(self.b(self.cut(self.a(x))))


class TupleCut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.cut = CutPoint()

    def forward(self, x):
        h, g = self.cut((self.a(x), x))
        return h + g


class NotBatchFirst(nn.Module):
    def __init__(self, reduce: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.cut = CutPoint()
        self.reduce = reduce

    def forward(self, x):
        h = self.a(x)
        return self.cut(h.sum() if self.reduce else h.t()).sum()


class Reordered(nn.Module):
    """CutPoints registered in one order, called in another; one is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.unused = CutPoint(), CutPoint(), CutPoint()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.c(self.first(self.b(self.second(self.a(x)))))


def test_discover_cutpoints_on_tinylm(model, idx):
    assert discover_cutpoints(model, (idx,)) == ["cuts.0", "cuts.1", "cuts.2", "cuts.3"]
    assert all(cut._observer is None for cut in all_cutpoints(model))
    assert all(p.grad is None for p in model.parameters())


def test_discover_cutpoints_returns_execution_order_and_warns_of_uncalled():
    with pytest.warns(UserWarning, match=r"`unused`: CutPoint\(s\) that `Reordered.forward` never calls"):
        assert discover_cutpoints(Reordered(), (torch.randn(2, 3),)) == ["second", "first"]


def test_a_cutpoint_on_the_forward_s_output_is_left_out_without_a_warning():
    """A CutPoint whose output is the model's (``cut_after`` on every layer) has no work after it: it is called, so
    nothing warns that the forward never calls it, and it begins no stage."""

    class EndsCut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.middle, self.end = nn.Linear(3, 3), nn.Linear(3, 3), CutPoint(), CutPoint()

        def forward(self, x):
            return self.end(self.b(self.middle(self.a(x))))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert discover_cutpoints(EndsCut(), (torch.randn(2, 3),)) == ["middle"]


def test_discover_cutpoints_accepts_kwargs():
    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.cut = nn.Linear(3, 3), CutPoint()

        def forward(self, x, *, scale):
            return self.cut(self.a(x)) * scale

    assert discover_cutpoints(Kw(), (torch.randn(2, 3),), {"scale": torch.tensor(2.0)}) == ["cut"]


def test_cut_after_sequentials_cuts_once_after_each():
    """torchvision's stages are ``nn.Sequential``s, which call every child: the CutPoint goes to the last layer."""
    body = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU())), nn.Linear(3, 3), nn.Linear(3, 2))
    cut_after([body[0], body[1]])
    assert len(body[0]) == 2 and len(body) == 3  # the model keeps its structure
    assert discover_cutpoints(body, (torch.randn(2, 3),)) == ["0.1.0.cutpoint", "1.cutpoint"]


class RunsItsChildren(nn.Module):
    """A stage whose forward runs its children itself, as timm's (``for block in self.children()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Tanh()

    def forward(self, x):
        for block in self.children():
            x = block(x)
        return x


def test_cut_after_a_module_that_runs_its_children_cuts_once_after_it():
    """Its CutPoint is one of those children: run by the loop it is the identity, and only its output is cut."""
    torch.manual_seed(0)
    body = nn.Sequential(RunsItsChildren(), RunsItsChildren(), nn.Linear(3, 2))
    x = torch.randn(2, 3)
    expected = body(x)
    cut_after([body[0], body[1]])
    assert discover_cutpoints(body, (x,)) == ["0.cutpoint", "1.cutpoint"]
    torch.testing.assert_close(body(x), expected, rtol=0, atol=0)


class SumsItsChildren(nn.Module):
    """Branches whose outputs are added up: a CutPoint among its children would be one more branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return sum(branch(x) for branch in self.children())


def test_cut_after_a_module_that_combines_its_children_says_where_to_cut():
    body = nn.Sequential(SumsItsChildren(), nn.Linear(3, 2))
    cut_after([body[0]])
    with pytest.raises(ValueError, match=r"`SumsItsChildren`, whose forward runs its children itself and combines"):
        discover_cutpoints(body, (torch.randn(2, 3),))


@pytest.mark.parametrize("container", [nn.ModuleList([nn.Linear(3, 3)]), nn.Sequential()], ids=["list", "empty"])
def test_cut_after_a_container_with_no_output_says_what_to_pass(container):
    with pytest.raises(ValueError, match="`cut_after` got a"):
        cut_after([container])


def test_cutpoint_called_twice():
    module = Twice()
    with pytest.raises(ValueError, match=r"`cut`.*twice"):
        discover_cutpoints(module, (torch.randn(2, 3),))
    assert module.cut._observer is None  # observers are removed even when discovery fails


def test_cutpoint_given_a_tuple():
    module = TupleCut()
    with pytest.raises(TypeError, match=r"`cut` got a value of type `tuple`"):
        discover_cutpoints(module, (torch.randn(2, 3),))
    assert module.cut._observer is None


@pytest.mark.parametrize("reduce", [False, True], ids=["transposed", "0-dim"])
def test_cutpoint_given_a_tensor_without_batch_dim(reduce):
    with pytest.raises(ValueError, match=r"`cut` got a tensor of shape .* run with has 2 rows"):
        discover_cutpoints(NotBatchFirst(reduce), (torch.randn(2, 3),))


def test_cutpoint_is_identity_outside_discovery():
    x = torch.randn(2, 3)
    assert CutPoint()(x) is x
    # Called twice is only an error while discovering; a plain forward works.
    Twice()(x)


def test_measure_segments_on_tinylm(model, idx):
    timings = measure_segments(model, (idx,), repeats=1)
    assert len(timings) == 5  # 4 CutPoints
    assert all(t.forward_s >= 0 and t.backward_s >= 0 and t.forward_no_grad_s >= 0 for t in timings)
    assert timings[-1].output_bytes == 0 and all(t.output_bytes > 0 for t in timings[:-1])
    # Measuring leaves no gradients and no observers behind.
    assert all(p.grad is None for p in model.parameters())
    assert all(cut._observer is None for cut in all_cutpoints(model))


def test_measure_segments_without_cutpoints():
    timings = measure_segments(nn.Linear(3, 2), (torch.randn(4, 3),), repeats=2)
    assert len(timings) == 1 and timings[0].forward_s >= 0


def test_measure_segments_reports_cutpoint_errors():
    with pytest.raises(ValueError, match="twice"):
        measure_segments(Twice(), (torch.randn(2, 3),), repeats=1)


def test_measuring_leaves_batchnorm_statistics_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_segments(model, (torch.randn(8, 3),), repeats=2)
    discover_cutpoints(model, (torch.randn(8, 3),))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------- skeleton


def test_skeleton_names_and_ties(model):
    skeleton = ModelSkeleton(model)
    names = [n for n, _ in model.named_parameters()]
    assert skeleton.parameter_names == names  # the tied head weight appears once, as `emb.weight`
    assert skeleton.canonical("head.weight") == "emb.weight"
    assert skeleton.canonical("emb.weight") == "emb.weight"
    assert skeleton.canonical("blocks.2.fc.bias") == "blocks.2.fc.bias"


def test_release_frees_parameters_not_kept(model):
    skeleton = ModelSkeleton(model)
    keep = {"emb.weight", "blocks.4.fc.weight", "blocks.4.fc.bias"}
    kept = {name: model.get_parameter(name) for name in keep}
    skeleton.release(model, keep)
    assert {n for n, _ in model.named_parameters()} == keep
    assert {id(p) for p in model.parameters()} == {id(p) for p in kept.values()}
    assert model.blocks[0].fc.weight is None
    assert model.blocks[4].norm.weight is None
    # The tied head keeps its (kept) weight.
    assert model.head.weight is model.emb.weight is kept["emb.weight"]


def test_release_of_tied_weight_frees_both_slots(model):
    skeleton = ModelSkeleton(model)
    skeleton.release(model, {"blocks.0.fc.weight"})
    assert model.emb.weight is None
    assert model.head.weight is None
    assert [n for n, _ in model.named_parameters()] == ["blocks.0.fc.weight"]


def test_stand_ins_fill_every_slot_and_restore_originals(model, idx):
    skeleton = ModelSkeleton(model)
    originals = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    shapes = {name: p.shape for name, p in originals.items()}
    keep = {"blocks.1.fc.weight", "blocks.1.fc.bias", "emb.weight"}
    skeleton.release(model, keep)

    with skeleton.stand_ins(model):
        inside = dict(model.named_parameters(remove_duplicate=False))
        assert set(inside) == set(shapes)
        for name, tensor in inside.items():
            assert isinstance(tensor, nn.Parameter)
            assert tensor.shape == shapes[name]
            assert tensor.requires_grad
            assert tensor is not originals[name]
            assert tensor.untyped_storage().nbytes() == tensor.element_size()  # one element of memory
        assert model.head.weight is model.emb.weight  # ties preserved
        out = model(idx)  # runs shape-wise (the values are meaningless)
        assert out.shape == (BATCH, SEQ, VOCAB)

    after = dict(model.named_parameters(remove_duplicate=False))
    assert set(after) == {"emb.weight", "head.weight", "blocks.1.fc.weight", "blocks.1.fc.bias"}
    for name, tensor in after.items():
        assert tensor is originals[name]
    assert model.head.weight is model.emb.weight
    assert model.blocks[0].fc.weight is None  # released slots are empty again


def test_stand_ins_restore_after_an_exception(model):
    skeleton = ModelSkeleton(model)
    original = model.blocks[2].fc.weight
    with pytest.raises(RuntimeError, match="boom"), skeleton.stand_ins(model):
        assert model.blocks[2].fc.weight is not original
        raise RuntimeError("boom")
    assert model.blocks[2].fc.weight is original


def test_skeleton_handles_buffers():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    running_mean = module[1].running_mean
    skeleton = ModelSkeleton(module)
    skeleton.release(module, {"0.weight", "1.running_mean"})
    assert [n for n, _ in module.named_parameters()] == ["0.weight"]
    assert [n for n, _ in module.named_buffers()] == ["1.running_mean"]
    with skeleton.stand_ins(module):
        buffers = dict(module.named_buffers())
        assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        assert not isinstance(buffers["1.running_var"], nn.Parameter)
        assert buffers["1.running_var"].shape == (3,)
        assert buffers["1.num_batches_tracked"].dtype == torch.long
        assert module(torch.randn(5, 3)).shape == (5, 3)
    assert module[1].running_mean is running_mean
    assert module[1].running_var is None


# ----------------------------------------------------------------------------------------------- split


def split_all(module: TinyLM, idx: torch.Tensor, boundaries=BOUNDARIES):
    skeleton = ModelSkeleton(module)
    real = real_tensors(module)
    graphs, stages = [], []
    for stage_index in range(len(boundaries) + 1):
        graph, stage = split_into_stages(module, skeleton, real, (idx,), {}, boundaries, stage_index)
        graphs.append(graph)
        stages.append(stage)
    return graphs, stages


@pytest.fixture(scope="module")
def tinylm_split():
    """TinyLM cut before `cuts.1` and `cuts.3`: (model, idx, graph, stage modules); traced once per module."""
    torch.manual_seed(0)
    model, idx = TinyLM(), make_idx()
    graphs, stages = split_all(model, idx)
    for other in graphs[1:]:
        assert other.stage_inputs == graphs[0].stage_inputs
        assert other.stage_outputs == graphs[0].stage_outputs
        assert other.output_sources == graphs[0].output_sources
        assert other.stage_parameters == graphs[0].stage_parameters
    return model, idx, graphs[0], stages


def run_by_hand(graph: PipelineGraph, stages, inputs: list[torch.Tensor]):
    outputs: list[tuple] = []
    for stage_index, stage in enumerate(stages):

        def lookup(src: Source):
            return inputs[src.index] if src.stage is None else outputs[src.stage][src.index]

        args = [lookup(src) for src in graph.stage_inputs[stage_index]]
        for src in graph.stage_inputs[stage_index]:
            assert src.stage is None or src.stage < stage_index
        out = stage(*args)
        outputs.append(out if isinstance(out, tuple) else (out,))
    return [
        inputs[src.index] if src.stage is None else outputs[src.stage][src.index] for src in graph.output_sources
    ], outputs


def test_split_tinylm_into_three_stages(tinylm_split):
    model, _, graph, stages = tinylm_split
    assert graph.num_stages == 3
    assert len(stages) == 3
    assert graph.stage_inputs[0] == [Source(None, 0)]
    assert graph.output_sources == [Source(2, 0)]
    assert graph.stage_outputs[2] == [TensorMeta(torch.Size([BATCH, SEQ, VOCAB]), torch.float32)]
    assert TensorMeta(torch.Size([BATCH, SEQ, DIM]), torch.float32) in graph.stage_outputs[0]
    # The padding mask every block reads is made from the inputs: no gradient flows back into it (none is sent).
    assert TensorMeta(torch.Size([BATCH, SEQ, 1]), torch.float32, needs_grad=False) in graph.stage_outputs[0]

    # The tied embedding / head weight lives on the first and the last stage.
    assert "emb.weight" in graph.stage_parameters[0]
    assert "emb.weight" in graph.stage_parameters[2]
    assert "emb.weight" not in graph.stage_parameters[1]
    assert "head.weight" not in set().union(*graph.stage_parameters)  # canonical names only
    blocks_of = [{name.split(".")[1] for name in ps if name.startswith("blocks.")} for ps in graph.stage_parameters]
    assert blocks_of == [{"0", "1"}, {"2", "3"}, {"4"}]
    assert set().union(*graph.stage_parameters) == set(ModelSkeleton(model).parameter_names)

    # Each stage module holds the model's own parameter tensors (no copies), named as in the model.
    own = dict(model.named_parameters())
    skeleton = ModelSkeleton(model)
    for stage_index, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            assert p is own[skeleton.canonical(name)], name
        assert {id(p) for p in stage.parameters()} == {id(own[n]) for n in graph.stage_parameters[stage_index]}


def test_split_graph_edges_of_tinylm(tinylm_split):
    _, _, graph, _ = tinylm_split
    producers = {s: {src.stage for src in graph.stage_inputs[s] if src.stage is not None} for s in range(3)}
    # The mask computed on stage 0 crosses to stage 2 besides the activations flowing 0 -> 1 -> 2.
    assert producers == {0: set(), 1: {0}, 2: {0, 1}}
    assert set(graph.sends(0)) == {1, 2}
    assert set(graph.receives(2)) == {0, 1}
    assert graph.receives(0) == {}
    assert graph.sends(2) == {}
    for (producer, consumer), values in graph.edges.items():
        assert producer < consumer
        assert graph.sends(producer)[consumer] == values == graph.receives(consumer)[producer]
        assert all(0 <= v < len(graph.stage_outputs[producer]) for v in values)
    # The schedules are valid for this cut's real producer graph.
    for generator in (forward_only, gpipe, one_f_one_b):
        dry_run(generator(3, 5), producers)


def test_stages_run_by_hand_reproduce_the_model(tinylm_split):
    model, idx, graph, stages = tinylm_split
    with torch.no_grad():
        expected = model(idx)
        (actual,), outputs = run_by_hand(graph, stages, [idx])
    for stage_index, out in enumerate(outputs):
        assert [(t.shape, t.dtype) for t in out] == [(m.shape, m.dtype) for m in graph.stage_outputs[stage_index]]
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_stages_run_as_generated_code_not_through_the_fx_interpreter(tinylm_split, monkeypatch):
    """Stepping through the graph node by node costs as much again as a small model's forward."""
    model, idx, graph, stages = tinylm_split
    interpreted = []
    run = torch.fx.Interpreter.run

    def counted_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        interpreted.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Interpreter, "run", counted_run)
    with torch.no_grad():
        run_by_hand(graph, stages, [idx])
    assert interpreted == []


def test_stages_run_by_hand_give_the_model_gradients(tinylm_split):
    model, idx, graph, stages = tinylm_split
    model.zero_grad(set_to_none=True)
    model(idx).square().mean().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (actual,), _ = run_by_hand(graph, stages, [idx])
    actual.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)
    model.zero_grad(set_to_none=True)


def test_split_works_after_releasing_other_stages(model, idx):
    reference = copy.deepcopy(model)
    full = real_tensors(model)
    skeleton = ModelSkeleton(model)
    graph, _ = split_into_stages(model, skeleton, full, (idx,), {}, BOUNDARIES, 0)
    # The rank of stage 1 keeps only its own parameters, then traces again with stand-ins for the rest.
    keep = graph.stage_parameters[1]
    skeleton.release(model, keep)
    assert {n for n, _ in model.named_parameters()} == keep
    own = {name: t for name, t in full.items() if name in keep}
    graph1, stage1 = split_into_stages(model, skeleton, own, (idx,), {}, BOUNDARIES, 1)
    assert graph1.stage_inputs == graph.stage_inputs
    assert graph1.stage_outputs == graph.stage_outputs
    assert graph1.stage_parameters == graph.stage_parameters
    assert {n for n, _ in model.named_parameters()} == keep  # the stand-ins are gone again
    for name, p in stage1.named_parameters():
        assert p is full[name]

    # Stage 1 computes what stage 1 of the whole model computes.
    _, stages = split_all(reference, idx)
    with torch.no_grad():
        expected = reference(idx)
        (actual,), outputs = run_by_hand(graph, stages, [idx])
        args = [outputs[src.stage][src.index] for src in graph.stage_inputs[1]]
        torch.testing.assert_close(stage1(*args), outputs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_cutpoints_are_inactive_after_split(tinylm_split):
    model, idx, _, _ = tinylm_split
    assert not any(cut._is_stage_boundary for cut in all_cutpoints(model))
    assert discover_cutpoints(model, (idx,)) == ["cuts.0", "cuts.1", "cuts.2", "cuts.3"]


def test_split_with_an_empty_stage_raises():
    class BackToBack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.c0, self.c1 = CutPoint(), CutPoint()

        def forward(self, x):
            return self.b(self.c1(self.c0(self.a(x))))

    module = BackToBack()
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"gave 2 stage\(s\) instead of 3"):
        split_into_stages(module, ModelSkeleton(module), real_tensors(module), (x,), {}, ["c0", "c1"], 0)
    assert not module.c0._is_stage_boundary and not module.c1._is_stage_boundary


# ----------------------------------------------------------------------------------------------- untraceable forwards


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cut(self.a(x))
        if x.sum() > 0:
            x = x * 2
        return self.b(x)


class CausalEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.cut = CutPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.encoder(self.cut(x), mask=mask)


def line_of(function: object, code: str) -> int:
    """The number of the first line of ``function``'s source that contains ``code``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if code in line)


def test_untraceable_forward_names_the_users_line():
    module = ValueBranch()
    with pytest.raises(RuntimeError) as info:
        split_into_stages(module, ModelSkeleton(module), real_tensors(module), (torch.randn(2, 4),), {}, ["cut"], 0)
    message = str(info.value)
    assert message.startswith("Cannot cut `ValueBranch.forward` into pipeline stages")
    assert f"line {line_of(ValueBranch.forward, 'if x.sum()')} of {__file__} (`if x.sum() > 0:`)" in message
    assert "depends on a tensor's values" in message and "torch.where(condition, a, b)" in message
    assert not module.cut._is_stage_boundary


class Cache:
    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class ReturnsACache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        keys = self.cut(self.a(x))
        return self.b(keys), Cache(keys)


def test_a_forward_returning_an_object_that_is_not_tensors_says_what_to_return():
    module = ReturnsACache()
    with pytest.raises(TypeError, match=r"`ReturnsACache.forward`.* returns a `Cache`.*return what the step needs"):
        split_into_stages(module, ModelSkeleton(module), real_tensors(module), (torch.randn(2, 4),), {}, ["cut"], 0)


def test_hugging_face_models_are_cut_without_their_kv_cache():
    """GPT-2 returns its key/value cache by default (``use_cache=True``): the stages compute the rest as the model."""
    from real_models import HFGPT2

    model = HFGPT2()
    ids = torch.randint(0, 50, (2, 8))
    expected = model(ids)
    assert expected.past_key_values is not None  # what the model returns by default, uncut
    stages = split_into_all_stages(
        model, ModelSkeleton(model), real_tensors(model), (ids,), {}, ["model.transformer.h.0.cutpoint"]
    )[1]
    hidden = stages[0](ids)
    logits = stages[1](*[hidden] if isinstance(hidden, torch.Tensor) else hidden)
    torch.testing.assert_close(logits, expected.logits)
    assert model.model.config.use_cache  # as the user left it


def test_causal_mask_check_is_traceable_and_named_without_the_patch(monkeypatch):
    """``nn.TransformerEncoder`` reads its mask's values: traced as written; without the patch torch's line is named."""
    module, x = CausalEncoder(), torch.randn(2, 5, 8)
    split_into_stages(module, ModelSkeleton(module), real_tensors(module), (x,), {}, ["cut"], 1)
    assert transformer_module._detect_is_causal_mask is detect_is_causal_mask  # patched only while tracing
    monkeypatch.setattr(lightning_varuna.partition.split, "traceable_torch_modules", contextlib.nullcontext)
    with pytest.raises(RuntimeError) as info:
        split_into_stages(module, ModelSkeleton(module), real_tensors(module), (x,), {}, ["cut"], 1)
    message = str(info.value)
    assert f"line {line_of(CausalEncoder.forward, 'self.encoder(')} of {__file__}" in message
    assert f"inside line {line_of(detect_is_causal_mask, 'make_causal = bool(')} of " in message
    assert "as `is_causal=` does for an attention mask" in message


def test_a_float32_causal_mask_meets_a_float64_model_s_attention_in_float64():
    """Traced, the decoder applies ``generate_square_subsequent_mask``'s float32 mask rather than its causal shortcut
    (which takes no mask): widened to the queries' float64, which torch's CPU attention kernel reads right (given the
    float32 mask beside float64 queries it computed other outputs: a 64-true run trained another model)."""

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerDecoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            self.decoder, self.cut = nn.TransformerDecoder(layer, num_layers=2), CutPoint()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=torch.float32)
            return self.decoder(self.cut(x), x, tgt_mask=mask)

    torch.manual_seed(0)
    module, x = Decoder().double(), torch.randn(2, 16, 8, dtype=torch.float64)  # from 8 tokens the kernel erred
    graph, stages = split_into_all_stages(module, ModelSkeleton(module), real_tensors(module), (x,), {}, ["cut"])
    masks = [
        node.args[3].meta["val"].dtype
        for stage in stages
        for sub in stage.modules()
        if isinstance(getattr(sub, "graph", None), torch.fx.Graph)
        for node in sub.graph.nodes
        if node.target is torch.ops.aten.scaled_dot_product_attention.default and len(node.args) > 3
    ]
    assert masks == [torch.float64, torch.float64]  # each layer's self-attention; none for the cross-attention
    assert F._canonical_mask is canonical_mask  # patched only while tracing
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = module(x)
    torch.testing.assert_close(run_by_hand(graph, stages, [x])[0][0], expected)


def test_forward_hooks_run_in_the_stages_and_backward_hooks_are_named_in_a_warning(model, idx):
    model.blocks[0].register_forward_hook(lambda module, args, out: out * 2)
    model.blocks[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    expected = model(idx)
    with pytest.warns(UserWarning, match=r"The backward hooks of blocks\.2 will not run"):
        graphs, stages = split_all(model, idx)
    actual, _ = run_by_hand(graphs[0], stages, [idx])
    torch.testing.assert_close(actual[0], expected, rtol=0, atol=0)


def test_stand_ins_for_missing_tensors_leave_the_real_ones_as_the_block_changed_them():
    """Lightning's teardown moves the module (`.cpu()`) with stand-ins in the released slots: the stage's own
    tensors keep the move, the released slots are empty again."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    skeleton = ModelSkeleton(model)
    skeleton.release(model, keep={"1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"})
    with skeleton.stand_ins(model, missing_only=True, device=torch.device("cpu")):
        model.double()
    assert model[0].weight is None
    assert model[1].weight.dtype == model[1].running_mean.dtype == torch.float64
