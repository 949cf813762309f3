"""What a user brings: a LightningModule written for Lightning's `ModelParallelStrategy`, not for lit3d."""

from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class RegressionData(L.LightningDataModule):
    """64 fixed random (x, y) pairs in batches of 4; Lightning adds the distributed sampler."""

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.flip(-1) * 0.5), batch_size=4)


class ParallelisesItself(L.LightningModule):
    """A two-layer MLP that applies its own tensor parallelism (Lightning's mesh names) and FSDP2 in
    `configure_model`, as Lightning's `ModelParallelStrategy` documentation shows.

    Args:
        tensor_parallel: Split the layers over ``device_mesh["tensor_parallel"]``.
        data_parallel: `fully_shard` over ``device_mesh["data_parallel"]``; ``"replicate"``: FSDP2's replicate
            (no sharding, no broadcast of the weights); ``False``: nothing syncs the replicas.
        seed_by_rank: Draw the weights from a per-rank seed (replicas that start apart).
        gain: A scalar parameter beside the network, outside its data parallelism, that scales its output:
            ``"frozen"`` (no gradient), ``"averaged"`` (its own gradient hook averages it over the replicas),
            ``"hooked"`` (a hook that does not), or None (no such parameter).
    """

    def __init__(
        self,
        tensor_parallel: bool = True,
        data_parallel: bool | str = True,
        seed_by_rank: bool = False,
        gain: str | None = None,
    ):
        super().__init__()
        self.tensor_parallel, self.data_parallel, self.seed_by_rank = tensor_parallel, data_parallel, seed_by_rank
        self.net: nn.Module | None = None
        self.gain = None if gain is None else nn.Parameter(torch.ones(1), requires_grad=gain != "frozen")
        if gain in ("averaged", "hooked"):
            self.gain.register_hook(self._averaged if gain == "averaged" else lambda grad: grad)

    def _averaged(self, grad: torch.Tensor) -> torch.Tensor:
        group = self.device_mesh["data_parallel"].get_group()
        torch.distributed.all_reduce(grad, group=group)
        return grad / torch.distributed.get_world_size(group)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.net is not None:
            return
        if self.seed_by_rank:
            torch.manual_seed(self.global_rank)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        if self.tensor_parallel:
            # NOTE: the row-parallel output stays a DTensor inside the FSDP2 unit, and `training_step` takes its local
            # tensor: `to_local()` is a view, and FSDP2 warns about a unit that returns one (an in-place op on it would
            # drop the unit's pre-backward hook).
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
        if self.data_parallel == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.data_parallel:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        out = out.to_local() if hasattr(out, "to_local") else out  # a DTensor under TP (`configure_model`)
        loss = F.mse_loss(out if self.gain is None else out * self.gain, y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class TokenData(L.LightningDataModule):
    """48 fixed random token sequences of 17 in batches of 4; Lightning adds the distributed sampler."""

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, 64, (48, 17), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=4)


def token_blocks(vocab: int, rows: int, tokens: int) -> torch.Tensor:
    """``rows`` fixed random blocks of ``tokens`` tokens: a lit3d GPT's batches, as a user's own dataset holds them."""
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))


class UsersBlocks(L.LightningDataModule):
    """A user's own data module of token blocks (`token_blocks`), which says neither a global batch nor a length."""

    def __init__(self, vocab: int, rows: int, tokens: int, batch_size: int) -> None:
        super().__init__()
        self.blocks, self.batch_size = token_blocks(vocab, rows, tokens), batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.blocks, batch_size=self.batch_size, drop_last=True)


def fed_data(vocab: int, source: str, rows: int, tokens: int, batch_size: int) -> Any:
    """What a lit3d GPT's fit is fed that is not a lit3d data module: a plain ``DataLoader`` (``"loader"``) or a
    user's ``LightningDataModule`` (``"user_module"``)."""
    if source == "loader":
        return DataLoader(token_blocks(vocab, rows, tokens), batch_size=batch_size, drop_last=True)
    return UsersBlocks(vocab, rows, tokens, batch_size)


class Block(nn.Module):
    """A Llama block: RMSNorm, causal attention (wq, wk, wv, wo), RMSNorm, SwiGLU (w1, w3, w2)."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3, self.w2 = nn.Linear(dim, 64, bias=False), nn.Linear(dim, 64, bias=False), nn.Linear(64, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        q, k, v = (w(h) for w in (self.wq, self.wk, self.wv))
        b, s = q.shape[:2]  # the whole sequence (the block's input may be this rank's part of it)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(attention)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layers = nn.Embedding(64, 32), nn.ModuleList([Block(), Block()])
        self.norm, self.output = nn.RMSNorm(32), nn.Linear(32, 64, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


class LlamaTP(L.LightningModule):
    """Lightning's tensor-parallel example in small (`examples/pytorch/tensor_parallel`), written anew: a Llama with
    tensor and sequence parallelism by `parallelize_module`, then FSDP2 per block and over the whole model, all in
    `configure_model` with Lightning's mesh names, and `loss_parallel()` around its loss and its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        if self.model is not None:
            return
        self.model = Llama()
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.model, tp, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })  # fmt: skip
        for block in self.model.layers:
            parallelize_module(
                block,
                tp,
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "wq": ColwiseParallel(),
                    "wk": ColwiseParallel(),
                    "wv": ColwiseParallel(),
                    "wo": RowwiseParallel(output_layouts=Shard(1)),
                    "w1": ColwiseParallel(),
                    "w3": ColwiseParallel(),
                    "w2": RowwiseParallel(output_layouts=Shard(1)),
                },
            )  # fmt: skip  (the norms' outputs are split along the sequence; the colwise layers gather them)
        for block in self.model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.parallel import loss_parallel

        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        with loss_parallel():
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss, on_step=True)
        return loss

    def backward(self, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
