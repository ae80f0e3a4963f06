"""Models the project did not write, with CutPoints added the way a user would, and data for each.

* ``bn_mlp``: an MLP with ``nn.BatchNorm1d`` before its first CutPoint (BatchNorm statistics are per micro-batch).
* ``resnet``: Hugging Face ``ResNetForImageClassification`` (BatchNorm2d; its output is a ``ModelOutput`` dict).
  torchvision and timm cannot be installed beside the CPU-only torch (their operators need a matching CUDA build),
  so the library CNN is transformers' own ResNet.
* ``bert``: Hugging Face ``BertForMaskedLM`` fed dict batches (``input_ids``, a padded ``attention_mask``,
  ``labels``): several tensor inputs, a submodule named ``self``.
* ``gpt2``: Hugging Face ``GPT2LMHeadModel``, its LM head tied to the token embedding.
* ``llama``: Hugging Face ``LlamaForCausalLM`` (rotary positions, grouped-query attention, RMSNorm), its LM head tied
  to the token embedding.
* ``t5``: Hugging Face ``T5ForConditionalGeneration`` (encoder and decoder, one embedding shared by both and the LM
  head, a relative position bias each stack's first block makes and its other blocks read).
* ``demo_transformer``: Lightning's own ``lightning.pytorch.demos.Transformer`` (``nn.Transformer``, two inputs).
* ``causal_encoder``: ``nn.TransformerEncoder`` with a causal mask from
  ``nn.Transformer.generate_square_subsequent_mask``.

All random init from small configs (nothing is downloaded) and no dropout. CutPoints go after library layers with
``cut_after``. ``step_loss`` is the loss of one (micro-)batch; the single-device reference runs it per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_varuna import CutPoint, cut_after

ROWS = 24


class RealModel(L.LightningModule):
    """``training_step`` as users write it, around ``step_loss``."""

    def step_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.step_loss(batch)
        self.log("train_loss", loss, sync_dist=True)  # the mean over replicas, as under DDP
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step_loss(batch))  # what a study monitors

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD as Lightning's demo Transformer uses: attention's key bias gets a gradient that is zero but for rounding,
        # which Adam would scale up into full-size steps that differ between any two ways of computing it.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BatchNormMLP(RealModel):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.mid, self.out = nn.Linear(16, 16), nn.Linear(16, 3)
        self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cuts[0](torch.relu(self.bn(self.inp(x))))
        return self.out(self.cuts[1](torch.relu(self.mid(x))))

    def step_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class HFImageClassifier(RealModel):
    """A Hugging Face image classifier (``self.model``) trained on its own loss."""

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(pixel_values=pixel_values, labels=labels)  # an ImageClassifierOutput (a dict)

    def step_loss(self, batch: Any) -> torch.Tensor:
        return self(*batch).loss


class HFResNet(HFImageClassifier):
    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, layer_type="basic")
        self.model = ResNetForImageClassification(config)
        cut_after(self.model.resnet.encoder.stages)


class HFBert(RealModel):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = BertForMaskedLM(config)
        cut_after(self.model.bert.encoder.layer)

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.model(**batch)

    def step_loss(self, batch: Any) -> torch.Tensor:
        return self(batch).loss


GPT2_VOCAB = 50


def tiny_gpt2() -> nn.Module:
    """Hugging Face's ``GPT2LMHeadModel`` from a small config (no dropout), a CutPoint after each of its 3 blocks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=GPT2_VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=3,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    cut_after(model.transformer.h)
    return model


class HFCausalLM(RealModel):
    """A Hugging Face causal LM (``self.model``) trained on next tokens."""

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids)  # with its key/value cache, as Hugging Face returns by default

    def step_loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).logits.flatten(0, 1), targets.flatten())


class HFGPT2(HFCausalLM):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2()


class HFGPT2OwnLoss(HFGPT2):
    """GPT-2 computing its own loss from labels, as Hugging Face's causal LMs do: the loss casts the logits to float32
    (``logits.float()``), a cast that is no-op in fp32 and real under bf16 autocast."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:  # type: ignore[override]
        return self.model(input_ids=input_ids, labels=labels)

    def step_loss(self, batch: Any) -> torch.Tensor:
        ids, _ = batch
        return self(ids, ids).loss


class HFGPT2FloatLogits(HFGPT2):
    """GPT-2 whose LightningModule's own forward casts the logits to float32 (``.float()``) for its loss."""

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids).logits.float()

    def step_loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())


class HFLlama(HFCausalLM):
    """Hugging Face's ``LlamaForCausalLM`` from a small config: 4 query heads sharing 2 key/value heads, tied head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=True,
        )
        self.model = LlamaForCausalLM(config)
        cut_after(self.model.model.layers)


class HFMixtral(HFCausalLM):
    """Hugging Face's ``MixtralForCausalLM`` from a small config: each layer routes every token to 2 of 4 experts, so
    which expert computes which token depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
        )
        self.model = MixtralForCausalLM(config)
        cut_after(self.model.model.layers)


class HFViT(HFImageClassifier):
    """Hugging Face's ``ViTForImageClassification`` from a small config: patches of 4 x 4 pixels, a class token."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=16,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = ViTForImageClassification(config)
        cut_after(self.model.vit.layers)


class HFT5(RealModel):
    """Hugging Face's ``T5ForConditionalGeneration`` from a small config, a CutPoint after each block of both stacks."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=50,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        self.model = T5ForConditionalGeneration(config)
        cut_after([*self.model.encoder.block, *self.model.decoder.block])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, labels=labels)

    def step_loss(self, batch: Any) -> torch.Tensor:
        return self(*batch).loss


class DemoTransformer(RealModel):
    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=33, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)
        cut_after([*self.model.transformer.encoder.layers, *self.model.transformer.decoder.layers])

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def step_loss(self, batch: Any) -> torch.Tensor:  # as lightning.pytorch.demos.LightningTransformer
        inputs, target = batch
        return F.nll_loss(self(inputs, target), target.reshape(-1))


class CausalEncoder(RealModel):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(33, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.head = nn.Linear(16, 33)
        cut_after(self.encoder.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.emb(ids), mask=mask))

    def step_loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())


class Samples(Dataset):
    """``ROWS`` samples made by ``make(index)`` with a generator seeded by the index."""

    def __init__(self, make: Callable[[torch.Generator, int], Any]) -> None:
        self.make = make

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> Any:
        return self.make(torch.Generator().manual_seed(index), index)


def _tokens(vocab: int, length: int) -> Callable[[torch.Generator, int], Any]:
    def make(g: torch.Generator, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (length + 1,), generator=g)
        return ids[:-1], ids[1:]

    return make


def _masked_tokens(g: torch.Generator, index: int) -> dict[str, torch.Tensor]:
    length = 4 + index % 5  # padded to 8: the attention mask differs per row
    mask = (torch.arange(8) < length).long()
    ids = torch.randint(1, 50, (8,), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


MODELS: dict[str, tuple[type[RealModel], Callable[[torch.Generator, int], Any]]] = {
    "bn_mlp": (BatchNormMLP, lambda g, i: (torch.randn(8, generator=g), torch.randint(0, 3, (), generator=g))),
    "resnet": (HFResNet, lambda g, i: (torch.randn(3, 16, 16, generator=g), torch.randint(0, 4, (), generator=g))),
    "bert": (HFBert, _masked_tokens),
    "gpt2": (HFGPT2, _tokens(50, 8)),
    "gpt2_own_loss": (HFGPT2OwnLoss, _tokens(50, 8)),
    "gpt2_float_logits": (HFGPT2FloatLogits, _tokens(50, 8)),
    "llama": (HFLlama, _tokens(50, 8)),
    "t5": (HFT5, _tokens(50, 8)),
    "mixtral": (HFMixtral, _tokens(50, 8)),
    "vit": (HFViT, lambda g, i: (torch.randn(3, 16, 16, generator=g), torch.randint(0, 4, (), generator=g))),
    "demo_transformer": (DemoTransformer, _tokens(33, 8)),
    "causal_encoder": (CausalEncoder, _tokens(33, 8)),
}


def build(name: str) -> tuple[RealModel, Dataset]:
    """The model ``name`` (seeded) and its data."""
    model_cls, make = MODELS[name]
    L.seed_everything(0, verbose=False)
    return model_cls(), Samples(make)
