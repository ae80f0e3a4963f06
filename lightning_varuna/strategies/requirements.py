"""What the strategies that run a step's forward and backward themselves need of the module and the callbacks."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_varuna.strategies.callback_hooks import callbacks_of

__all__ = [
    "WEIGHT_AVERAGING",
    "refuse_a_graph_of_the_whole_model",
    "refuse_pruning_as_it_trains",
    "require_automatic_optimization",
    "require_pipelined_training",
]

# Lightning's callbacks that keep an average of every parameter of the model.
WEIGHT_AVERAGING = (StochasticWeightAveraging, WeightAveraging)


def require_automatic_optimization(module: pl.LightningModule, strategy: str, runs: str) -> None:
    """Refuse manual optimization: ``strategy`` ``runs`` (the step's forward and backward, its way) itself."""
    if not module.automatic_optimization:
        raise TypeError(
            f"`{type(module).__name__}.automatic_optimization = False`: {strategy} runs {runs} itself and needs "
            "Lightning's automatic optimization. Remove `automatic_optimization = False` (and `manual_backward`), "
            "return the loss from `training_step`, and set `gradient_clip_val` / `accumulate_grad_batches` on the "
            "Trainer."
        )


def refuse_pruning_as_it_trains(trainer: pl.Trainer, runs: str) -> None:
    """Refuse Lightning's `ModelPruning`, whose masks are applied by hooks it adds to the pruned modules as the model
    trains, which the forward traced at set-up (that ``runs`` describes) does not run."""
    pruning = callbacks_of(trainer, ModelPruning)
    if pruning:
        raise ValueError(
            f"`{type(pruning[0]).__name__}` prunes the model as it trains, through hooks it adds to the pruned "
            f"modules, but {runs} as traced at set-up, without them: the pruned weights would still "
            "count. Prune before `fit` (`torch.nn.utils.prune`, whose masks the trace applies), or train without "
            "the callback."
        )


def refuse_a_graph_of_the_whole_model(trainer: pl.Trainer, holds: str) -> None:
    """Refuse `TensorBoardLogger(log_graph=True)` with an ``example_input_array``: after set-up it runs the whole
    model on that input in this process, which ``holds`` says it does not hold whole."""
    graphs = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger) and logger._log_graph]
    if graphs and trainer.lightning_module.example_input_array is not None:
        raise ValueError(
            "`TensorBoardLogger(log_graph=True)` draws the model's graph by running the whole model on its "
            f"`example_input_array` in one process, but {holds}. Set `log_graph=False`, or draw the graph in a run "
            "on one device without this strategy."
        )


def require_pipelined_training(trainer: pl.Trainer, strategy: str, num_stages: int) -> None:
    """Refuse what ``strategy``'s pipeline of ``num_stages`` stages cannot train: manual optimization, pruning as
    it trains, and, when several stages hold the model, a callback of ``trainer`` that averages every parameter and
    a graph of the whole model drawn by a logger."""
    require_automatic_optimization(
        trainer.lightning_module, strategy, "the pipelined forward and backward of `training_step`"
    )
    refuse_pruning_as_it_trains(trainer, f"{strategy} runs the forward")
    if num_stages > 1:
        refuse_a_graph_of_the_whole_model(trainer, f"with {num_stages} pipeline stages each process holds its stage's")
    averaging = callbacks_of(trainer, WEIGHT_AVERAGING)
    if averaging and num_stages > 1:
        raise ValueError(
            f"`{type(averaging[0]).__name__}` keeps an average of every parameter of the model, but with "
            f"{num_stages} pipeline stages each process holds only its stage's. Train "
            "with `pipeline_parallel_size=1` (data parallel: every process holds the whole model), or without the "
            "callback."
        )
