"""Multi-token prediction (DeepSeek-V3, Gloeckle et al. 2024): ``num_nextn_predict_layers`` depths after the decoder,
depth ``k`` predicting the token ``k + 1`` places after each input, as a training signal beside the next token's.

Depth ``k`` at input ``i`` reads two things: the hidden state the previous depth gave position ``i`` (depth 1: the
decoder's, after its final norm, as the head reads it) and the embedding of token ``i + k``. It normalises each
(``hnorm``, ``enorm``), projects the two side by side back to the model's width (``eh_proj``: 2·d → d), runs one
decoder block (an MoE block in an MoE model, as DeepSeek-V3's), normalises the result (``norm``, its own) and reads
the logits with the decoder's head; the embedding is the decoder's too (`lit3d.models.transformer.Transformer`). The
block attends causally over the whole row, as the decoder's do; depth ``k`` has no target at the row's last ``k``
positions, nor where the token it predicts lies past the end of the input's document (packed rows).

Its loss is the mean of the depths' cross-entropies, added to the next-token loss with ``mtp_loss_weight`` (DeepSeek-V3:
0.3, later 0.1); `lit3d.GPT` logs it as ``train_mtp_loss``. Only training runs the depths (``val_loss`` is the next
token's). Each depth's loss is the sum over its targets times
`TokensAhead`'s scale over the count of positions, so that the pieces of a batch that a layout computes apart
(data-parallel replicas, micro-batches, a context-parallel rank's chunks) average to the whole batch's loss: the mean
over the row positions that have a token ``k + 1`` ahead (plain rows: every target's mean). A target dropped at a
document's end or by a ``loss_mask`` counts as zero in that mean.

Under tensor parallelism (`lit3d.models.tp_plan`) the norms run on sequence shards as the decoder's do, ``eh_proj``
runs whole on every rank (a ``replicated_region``: it is one small matmul per token), and the block is split as every
block is. Under context parallelism the tokens ahead are taken from the whole rows before the rows are cut
(`lit3d.models.runner.ContextShare` cuts them with the inputs), so each rank's share is exact. Under pipeline
parallelism the depths sit on the last stage, with the head; the first stage, which holds the embedding, embeds the
tokens ahead and the stages hand those embeddings on with the hidden state (a second output and input of each stage),
so the embedding's gradient from the depths comes back through the pipeline's own backward, and the depths' loss joins
the objective through backward (`lit3d.models.loss.AddToObjective`), as the MoE layers' balance does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lit3d.models.batch_context import NO_CONTEXT, BatchContext, TokensAhead
from lit3d.models.block import Block, compute_dtype
from lit3d.models.config import GPTConfig
from lit3d.models.lora import LoRA
from lit3d.models.loss import IGNORED


class MultiTokenPrediction(nn.Module):
    """One depth of multi-token prediction (see the module's docstring); its parameters named as DeepSeek-V3's
    (``enorm``, ``hnorm``, ``eh_proj``; ``norm`` is its ``shared_head.norm``). After a training forward, ``stats``
    holds this depth's loss and ``history`` keeps it for each training forward since it was last cleared (the logged
    ``train_mtp_loss``), as `lit3d.models.moe.MoE` keeps its balance."""

    def __init__(self, config: GPTConfig, depth: int, lora: LoRA | None = None) -> None:
        super().__init__()
        self.depth = depth  # k: it predicts the token k + 1 places ahead
        d = config.d_model
        self.enorm = nn.RMSNorm(d, eps=config.norm_eps)
        self.hnorm = nn.RMSNorm(d, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        # NOTE: numbered after the decoder's blocks: an MoE block in an MoE model (`GPTConfig.is_moe_layer`), and its
        # MoE layer's statistics in their own row (`lit3d.GPT`'s balance).
        self.block = Block(config, config.n_layer + depth - 1, lora)
        self.norm = nn.RMSNorm(d, eps=config.norm_eps)
        self.stats: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, context: BatchContext = NO_CONTEXT) -> torch.Tensor:
        """The previous depth's hidden state and the embeddings of the tokens ``depth`` places ahead → this depth's
        hidden state (normalised: what the head reads, and the next depth)."""
        joined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)  # (DeepSeek-V3's order)
        return compute_dtype(self.norm(self.block(self.eh_proj(compute_dtype(joined)), context=context)))

    def record(self, loss: torch.Tensor) -> None:
        """Keep this forward's loss (`stats`), and in a training forward that is not a recompute, its `history`."""
        self.stats = loss
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.history.append(loss.detach())


def tokens_ahead(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    depths: int,
    positions: torch.Tensor | None = None,
    loss_scale: torch.Tensor | None = None,
) -> TokensAhead:
    """What ``depths`` depths read and predict, for the whole rows ``inputs`` and ``targets`` ``[batch, seq]`` (the
    targets the next tokens, ``IGNORED`` where the batch's ``loss_mask`` leaves them out). ``positions``
    ``[batch, seq + 1]``: each token's place in its document (packed rows; `lit3d.models.documents`), the target's
    included; ``loss_scale``: the batch's (chat data: `lit3d.GPT.loss`), which each depth's scale takes on."""
    batch, seq = inputs.shape
    if seq <= depths:
        raise ValueError(f"num_nextn_predict_layers={depths} needs rows of more than {depths} tokens; got {seq}")
    tokens, predicted, scales = [], [], []
    for k in range(1, depths + 1):
        tokens.append(torch.cat((inputs[:, k:], inputs.new_zeros(batch, k)), dim=1))
        ahead = torch.cat((targets[:, k:], targets.new_full((batch, k), IGNORED)), dim=1)
        if positions is not None:  # the token predicted must lie in the input's document
            segments = torch.cumsum(positions == 0, dim=1)
            apart = segments[:, k + 1 :] != segments[:, : -k - 1]
            ahead[:, : seq - k] = ahead[:, : seq - k].masked_fill(apart, IGNORED)
        predicted.append(ahead)
        scales.append(seq / (seq - k))
    scale = torch.tensor(scales, device=inputs.device).expand(batch, depths)
    if loss_scale is not None:
        scale = scale * loss_scale.to(scale.dtype)
    return TokensAhead(torch.stack(tokens, dim=-1), torch.stack(predicted, dim=-1), scale.contiguous())


def multi_token_loss(depths: list[MultiTokenPrediction]) -> torch.Tensor:
    """The mean of the depths' losses of the last forward: the term ``mtp_loss_weight`` weighs in the objective."""
    return torch.stack([depth.stats for depth in depths]).mean()


def step_loss(depths: list[MultiTokenPrediction], forwards: int) -> torch.Tensor:
    """The depths' loss, averaged over the last ``forwards`` training forwards (a step's), and their histories
    emptied."""
    losses = []
    for depth in depths:
        losses += depth.history[-forwards:]
        depth.history = []
    return torch.stack(losses).mean()
