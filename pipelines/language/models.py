"""Model code of the language team: a tiny transformer encoder that classifies token sequences.

`SequenceTransformer` is a `training.parallel.ParallelizableModule`, so the same
class trains in one process, under DDP, FSDP2 (one unit per block) and tensor
parallel (Megatron-style: q/k/v and the MLP's up projection colwise, the
attention output projection and the MLP's down projection rowwise, so a block
costs two all-reduces).
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
            f"heads={heads} cannot be split over tensor_parallel_size={tensor_parallel_size}: each rank needs whole heads; "
            f"use a tensor_parallel_size in {fits} or a multiple of {tensor_parallel_size} heads"
        )


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections.

    Under a colwise split of `q`, `k` and `v` each rank holds whole heads (a
    contiguous run of `head_dim` output features per head), so the number of
    heads a rank computes is read from the width of its local projection:
    `heads` on one process, `heads / tensor_parallel_size` under tensor
    parallelism. `out` (rowwise) then sums the ranks' partial outputs.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
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

        attended = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return self.out(attended.transpose(1, 2).reshape(batch, length, heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer encoder block: x + attn(norm(x)), then x + down(gelu(up(norm(x))))."""

    def __init__(self, width: int, heads: int, expansion: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * expansion)
        self.down = nn.Linear(width * expansion, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


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
        return {
            "blocks.*.attn.q": ColwiseParallel(),
            "blocks.*.attn.k": ColwiseParallel(),
            "blocks.*.attn.v": ColwiseParallel(),
            "blocks.*.attn.out": RowwiseParallel(),
            "blocks.*.up": ColwiseParallel(),
            "blocks.*.down": RowwiseParallel(),
        }

    @override
    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    @override
    def configure_model(self) -> None:
        # Fail before sharding: with a partial head per rank the reshape in SelfAttention would be wrong or fail.
        if self.device_mesh is not None:
            check_heads_split(self.hparams.heads, self.device_mesh["tensor_parallel"].size())
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
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
