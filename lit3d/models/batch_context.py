"""What a forward reads of its batch besides the tokens: one value, handed from the batch down to where it is read.

`lit3d.GPT.loss` makes it per batch: the packed rows' documents (`lit3d.models.documents`: attention keeps them apart)
and, in a training step with LoRA dropout, the samples its masks are drawn from (`lit3d.models.lora_dropout`). The
network takes it as an argument, ``network(tokens, context=...)``, and hands it to each block, whose attention reads
the documents and whose adapters the samples. Where a rank computes a part of the batch, its part of the context goes
with it:

- context parallelism cuts the documents to this rank's tokens with the inputs (`lit3d.models.runner.ContextShare`);
- a pipeline schedule splits the context into micro-batches as it splits the inputs, and hands each stage call its
  micro-batch's (`lit3d.strategies.pipelining.step`);
- activation checkpointing recomputes a block with the arguments its forward had, the context among them.

A pipeline's training step also sets ``objective_weight``, so that each stage's MoE layers add their balance loss to
the objective through backward (`lit3d.models.moe.MoE`). A batch of a model with multi-token prediction carries the
tokens its depths read and predict (`TokensAhead`, made from the whole rows: `lit3d.models.mtp`), cut with the inputs
wherever they are cut.

A new per-batch input (an attention mask, multi-token-prediction targets) is a field here, set where the batch is read
and read where it is needed; a tensor indexed by rows (dim 0) goes to each micro-batch's rows with the others.

NOTE: passed down, as torchtitan passes its ``extra_inputs``, rather than held per process: a value set aside for the
next forward must be cut again by every caller that computes a part of it (each micro-batch of a pipeline) and put back
around every call that runs without its caller (a block recomputed in backward). It is passed by keyword through
modules tensor parallelism styles: their input hooks keep the first positional argument only, and pass keyword ones on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import register_dataclass, tree_leaves

from lit3d.models.documents import Documents
from lit3d.models.lora_dropout import Samples


@dataclass(frozen=True)
class TokensAhead:
    """What multi-token prediction reads of a batch (`lit3d.models.mtp`), for each input token and depth ``k``
    (1 to ``num_nextn_predict_layers``), laid ``[batch, seq, depth]`` as the inputs are laid ``[batch, seq]``.

    Attributes:
        tokens: The token ``k`` places after the input, whose embedding depth ``k`` reads (0 past the row's end).
        targets: The token ``k + 1`` places after it, which depth ``k`` predicts (``IGNORED`` where there is none).
        scales: ``[batch, depth]``: what each depth's loss sum is multiplied by over its count of targets, the same
            for every row (its rows' tokens over those that have a target at that depth), so that the pieces of a
            batch (micro-batches, a context-parallel rank's share) average to the loss of the whole.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class BatchContext:
    """What a forward reads of its batch besides the tokens (see the module's docstring).

    Attributes:
        documents: The packed documents of the rows (``None``: every row is one sequence).
        samples: The rows' samples, which LoRA's dropout draws its masks from (``None``: not a training batch).
        objective_weight: What each MoE layer's balance loss is weighed by as it joins the training objective through
            backward, where the caller cannot add it to the loss: a pipeline, whose loss only the last stage sees (the
            weight of one micro-batch's loss). ``None``: the caller adds the balance loss to the loss it returns.
        ahead: The tokens multi-token prediction reads and predicts (``None``: it does not run).
    """

    documents: Documents | None = None
    samples: Samples | None = None
    objective_weight: float | None = None
    ahead: TokensAhead | None = None

    def documents_for(self, batch: int, seq: int) -> Documents | None:
        """The documents of the ``[batch, seq]`` tokens a forward computes, if its rows are packed."""
        documents = self.documents
        if documents is not None and tuple(documents.positions.shape) != (batch, seq):
            raise RuntimeError(
                f"packed documents of shape {tuple(documents.positions.shape)} handed to a forward over {batch}x{seq} "
                "tokens"
            )
        return documents

    def keywords(self) -> dict[str, BatchContext]:
        """The keyword argument that hands this context to a network, ``{"context": self}``, or none when it holds
        nothing: a module's own network run by lit3d's runners need not take one, and a pipeline schedule splits a
        keyword argument by what it holds."""
        return {"context": self} if tree_leaves(self) else {}


NO_CONTEXT = BatchContext()  # a forward over the tokens alone (frozen: one value every such forward shares)

# NOTE: PyTorch pytrees, so that a pipeline schedule splits a context into micro-batches as it splits the inputs
# (`torch.distributed.pipelining.microbatch.split_args_kwargs_into_chunks`: each tensor by rows, along dim 0; the seed
# as it is), and each micro-batch's documents make their masks anew for their rows.
register_dataclass(BatchContext)
register_dataclass(Documents, field_names=["positions", "segments", "whole_segments"], drop_field_names=["masks"])
register_dataclass(Samples)
register_dataclass(TokensAhead)
