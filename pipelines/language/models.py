"""Model code of the language team: a tiny transformer encoder that classifies token sequences
(`SequenceTransformer`) and a decoder-only language model (`DecoderLM`, task `causal_lm`).

Both are `training.parallel.ParallelizableModule`s, so the same class trains in
one process, under DDP, FSDP2 (one unit per block) and tensor parallel
(Megatron-style: q/k/v and the MLP's up projection colwise, the attention
output projection and the MLP's down projection rowwise, so a block costs two
all-reduces).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F
from typing_extensions import override

from training.errors import StrategyConfigError
from training.parallel import ClassifierSteps, ParallelizableModule


def check_heads_split(heads: int, tensor_parallel_size: int) -> None:
    """Raise unless tensor parallelism can give every rank whole attention heads.

    Raises:
        StrategyConfigError: naming `heads`, the size and the sizes that would work.
    """
    if heads % tensor_parallel_size:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise StrategyConfigError(
            f"heads={heads} cannot be split over tensor_parallel_size={tensor_parallel_size}: each rank needs whole "
            "heads; "
            f"use a tensor_parallel_size in {fits} or a multiple of {tensor_parallel_size} heads"
        )


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections.

    Under a colwise split of `q`, `k` and `v` each rank holds whole heads (a
    contiguous run of `head_dim` output features per head), so the number of
    heads a rank computes is read from the width of its local projection:
    `heads` on one process, `heads / tensor_parallel_size` under tensor
    parallelism. `out` (rowwise) then sums the ranks' partial outputs.
    With `causal`, position t attends to positions up to t only (a decoder).
    """

    def __init__(self, width: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim  # local heads: fewer than `heads` when q is split colwise

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, length, heads, self.head_dim).transpose(1, 2)

        attended = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=self.causal)
        return self.out(attended.transpose(1, 2).reshape(batch, length, heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + down(gelu(up(norm(x)))); a decoder block with
    `causal`."""

    def __init__(self, width: int, heads: int, expansion: int, causal: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * expansion)
        self.down = nn.Linear(width * expansion, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def block_plan() -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a stack of `Block`s under `blocks`: two all-reduces per block."""
    return {
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.out": RowwiseParallel(),
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.down": RowwiseParallel(),
    }


class SequenceTransformer(ClassifierSteps, ParallelizableModule):
    """Classifies fixed-length token sequences: embeddings, encoder blocks, mean pool, linear head.

    Token ids arrive as float32 feature columns (the platform's Parquet reader
    returns float features) and are cast to integers here, so the exported
    serving model takes the same float rows as every other team's.

    Args:
        n_features: sequence length (the platform passes the number of feature columns).
        n_classes: number of classes.
        vocab: number of distinct tokens; ids are 0..vocab-1.
        width: model width.
        heads: attention heads per block; under tensor parallelism
            `tensor_parallel_size` must divide `heads`.
        blocks: number of encoder blocks.
        expansion: MLP hidden width as a multiple of `width`.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = SequenceTransformer(n_features=32, n_classes=4, vocab=16)
        >>> model(torch.randint(0, 16, (8, 32)).float()).shape
        torch.Size([8, 4])
    """

    def __init__(
        self,
        n_features: int = 32,
        n_classes: int = 4,
        vocab: int = 16,
        width: int = 32,
        heads: int = 4,
        blocks: int = 1,
        expansion: int = 2,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(n_features, width)
        self.blocks = nn.ModuleList([Block(width, heads, expansion) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, n_classes)

    @override
    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return block_plan()

    @override
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @override
    def configure_model(self) -> None:
        # Fail before sharding: with a partial head per rank the reshape in SelfAttention would be wrong or fail.
        if self.device_mesh is not None:
            check_heads_split(self.hparams["heads"], self.device_mesh["tensor_parallel"].size())
        super().configure_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An embedding lookup on a strided view makes torch.export guard on the batch size; the
        # platform's reader yields row-major tensors, other callers may not.
        tokens = x.contiguous().long()
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])


class DecoderLM(ParallelizableModule):
    """A decoder-only (causal) transformer language model: token and learned position embeddings, causal
    blocks, a final norm and a linear head over the vocabulary (tied to the token embedding with `tie_weights`).

    `forward` maps token ids `[batch, length]` (length <= `block_size`) to next-token
    logits `[batch, length, vocab_size]`: position t's logits predict token t + 1.
    Batches are `(x, y)`, both int64 `[batch, block_size]`, `y` being `x` shifted one
    token (the platform's `training.streaming` data module yields them).

    Training minimises the mean next-token cross-entropy (logged as `train_loss`).
    Validation and test log `val_loss` / `test_loss`, the token-weighted mean
    cross-entropy (nats) over the whole split, and `val_perplexity` /
    `test_perplexity`, its exp: each rank sums its tokens' losses and counts them,
    the sums are all-reduced at the end of the epoch, so the value does not depend
    on the number of ranks or on how the split falls into batches.

    The platform fills `vocab_size` and `block_size` from the data module unless
    the pipeline sets them (`training.lightning_task.build`).

    Args:
        vocab_size: number of token ids (0..vocab_size-1), end-of-document included.
        block_size: the longest context; positions are learned up to it.
        width: model width.
        heads: attention heads per block; under tensor parallelism
            `tensor_parallel_size` must divide `heads`.
        blocks: number of decoder blocks (each one FSDP2 unit).
        expansion: MLP hidden width as a multiple of `width`.
        tie_weights: the output head shares the token embedding's weights.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = DecoderLM(vocab_size=100, block_size=16)
        >>> model(torch.randint(0, 100, (2, 16))).shape
        torch.Size([2, 16, 100])
    """

    def __init__(
        self,
        vocab_size: int = 257,
        block_size: int = 64,
        width: int = 64,
        heads: int = 4,
        blocks: int = 2,
        expansion: int = 4,
        tie_weights: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        if vocab_size < 2 or block_size < 1:
            raise ValueError(
                f"DecoderLM needs vocab_size >= 2 and block_size >= 1, got vocab_size={vocab_size}, "
                f"block_size={block_size}"
            )
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList([Block(width, heads, expansion, causal=True) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        for table in (self.embed, self.position):
            nn.init.normal_(table.weight, std=0.02)  # unit-variance embeddings would give a tied head huge first logits
        if tie_weights:
            self.head.weight = self.embed.weight
        self._sums: dict[str, torch.Tensor] = {}

    @override
    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        return block_plan()

    @override
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @override
    def configure_model(self) -> None:
        if self.device_mesh is not None:
            check_heads_split(self.hparams["heads"], self.device_mesh["tensor_parallel"].size())
        super().configure_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (
            x.contiguous().long()
        )  # see SequenceTransformer.forward: a strided view makes torch.export guard on sizes
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def _token_losses(self, batch: tuple[torch.Tensor, torch.Tensor], reduction: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1).long(), reduction=reduction)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._token_losses(batch, "mean")
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _accumulate(self, stage: str, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        summed = self._token_losses(batch, "sum").double()
        count = torch.tensor(float(batch[1].numel()), dtype=torch.float64, device=summed.device)
        totals = torch.stack([summed, count])
        self._sums[stage] = totals if stage not in self._sums else self._sums[stage] + totals

    def _log_split(self, stage: str) -> None:
        totals = self._sums.pop(stage, None)
        if totals is None:
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")  # every rank's tokens: exact over ranks
        loss = totals[0] / totals[1].clamp(min=1)
        # Equal on every rank already; sync_dist only keeps Lightning's epoch-level check quiet (a mean of equal
        # values).
        self.log(f"{stage}_loss", loss.float(), sync_dist=True)
        self.log(f"{stage}_perplexity", loss.exp().float(), prog_bar=stage == "val", sync_dist=True)

    @override
    def on_validation_epoch_start(self) -> None:
        self._sums.pop("val", None)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._accumulate("val", batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_split("val")

    @override
    def on_test_epoch_start(self) -> None:
        self._sums.pop("test", None)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._accumulate("test", batch)

    @override
    def on_test_epoch_end(self) -> None:
        self._log_split("test")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])
