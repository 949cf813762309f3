"""What a user brings: a LightningModule written for Lightning's `ModelParallelStrategy`, not for lit3d."""

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
    """

    def __init__(self, tensor_parallel: bool = True, data_parallel: bool | str = True, seed_by_rank: bool = False):
        super().__init__()
        self.tensor_parallel, self.data_parallel, self.seed_by_rank = tensor_parallel, data_parallel, seed_by_rank
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.net is not None:
            return
        if self.seed_by_rank:
            torch.manual_seed(self.global_rank)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        if self.tensor_parallel:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
        if self.data_parallel == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.data_parallel:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
