"""Models to try the strategies on, as `lightning.pytorch.demos` has Lightning's.

`MLP` is the model that the benchmarks (`benchmarks/spilling.py`, `benchmarks/multi_model.py`) and the tests train:
a stack of equal Linear layers with a CutPoint after each, whose size is set by two numbers. It is the smallest model
on which VarunaStrategy cuts stages and SpillingStrategy spills shards, and its memory is easy to reckon: a layer of
width ``w`` holds ``w * w + w`` parameters, four times that with their gradients and AdamW's two moments.

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_varuna import SpillingStrategy
    from lightning_varuna.demos import MLP

    data = TensorDataset(torch.randn(256, 512), torch.randn(256, 512))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=SpillingStrategy(memory_budget="40MB"), max_steps=8)
    trainer.fit(MLP(512, 24), DataLoader(data, batch_size=32))  # 96 MiB of state, spilled in shards of 40 MB
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_varuna.cutpoint import CutPoint

__all__ = ["ACTIVATIONS", "OPTIMIZERS", "MLP"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
}
"""The activations `MLP` takes by name."""

OPTIMIZERS = ("adamw", "sgd")
"""The optimizers `MLP` builds: AdamW, or SGD with momentum 0.9."""


class MLP(L.LightningModule):
    """``layers`` layers ``nn.Linear(width, width)``, each followed by the activation (then dropout, if any), with a
    CutPoint after each layer but the last: ``layers`` segments to cut into stages or shards. A regression model:
    a batch is ``(x, y)``, both of shape ``(rows, width)``, and the loss is the mean squared error of ``self(x)``
    against ``y``, logged as ``train_loss`` (``val_loss`` in validation); ``predict_step`` returns ``self(x)``.

    The defaults, 24 layers of width 512, make 24 MiB of parameters, 96 MiB with their gradients and AdamW's moments.

    Args:
        width: the features of every layer's input and output (and of ``x`` and ``y``).
        layers: how many Linear layers (at least 1); ``layers - 1`` CutPoints sit between them.
        activation: a name in `ACTIVATIONS` (``"tanh"``, ``"relu"``, ``"gelu"``, ``"sigmoid"``) or a function of a
            tensor, applied after every layer, the last one included.
        dropout: the probability of `nn.Dropout` after every activation; 0 for none.
        optimizer: ``"adamw"`` (`torch.optim.AdamW`) or ``"sgd"`` (`torch.optim.SGD` with momentum 0.9).
        lr: the optimizer's learning rate.
        build_in_configure_model: build the layers in `configure_model` instead of ``__init__``: a strategy that
            builds the model there on the meta device (`SpillingStrategy`) then gives it memory a segment at a time,
            so that it is never whole in memory. The layers' initial values are then drawn at set-up.
    """

    def __init__(
        self,
        width: int = 512,
        layers: int = 24,
        *,
        activation: str | Callable[[Tensor], Tensor] = "tanh",
        dropout: float = 0.0,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        if width < 1 or layers < 1:
            raise ValueError(f"`MLP(width={width}, layers={layers})`: both must be at least 1.")
        if isinstance(activation, str) and activation not in ACTIVATIONS:
            raise ValueError(f"`MLP(activation={activation!r})`: use one of {sorted(ACTIVATIONS)} or a function.")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"`MLP(optimizer={optimizer!r})`: use one of {list(OPTIMIZERS)}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`MLP(dropout={dropout})`: a probability in [0, 1).")
        self.width, self.num_layers, self.lr, self.optimizer_name = width, layers, lr, optimizer
        self.activation = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)
        self.layers: nn.ModuleList | None = None
        self.cuts: nn.ModuleList | None = None
        if not build_in_configure_model:
            self._build()

    def _build(self) -> None:
        self.layers = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(self.num_layers))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(self.num_layers - 1))

    def configure_model(self) -> None:
        """Build the layers, if ``__init__`` did not (``build_in_configure_model=True``): once."""
        if self.layers is None:
            self._build()

    def forward(self, x: Tensor) -> Tensor:
        if self.layers is None or self.cuts is None:
            raise RuntimeError("`MLP(build_in_configure_model=True)` has no layers before `configure_model` runs.")
        for i, layer in enumerate(self.layers):
            x = self.activation(layer(x))
            if self.dropout:
                x = self.drop(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)  # the global batch's mean under data parallelism
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
