"""The per-batch context (`lit3d.models.batch_context`): split into a pipeline's micro-batches as the schedule splits
its inputs, handed on only when it holds something, and one set of document masks per forward through FSDP2's casts."""

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.utils import _apply_to_tensors

from lit3d.models.batch_context import NO_CONTEXT, BatchContext
from lit3d.models.documents import Documents
from lit3d.models.lora_dropout import Samples


def packed_rows() -> BatchContext:
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([3, 5], [8], [2, 6], [1, 7])])
    return BatchContext(Documents.of(positions), Samples.strided(40, 2, 4, seed=7))


def test_a_pipeline_schedule_splits_the_context_by_rows_as_it_splits_the_inputs():
    context = packed_rows()
    context.documents.causal_bias(torch.float32)  # the whole batch's masks, made: no micro-batch may reuse them
    _, micro_batches = split_args_kwargs_into_chunks((), context.keywords(), 2)
    for i, kwargs in enumerate(micro_batches):
        part, rows = kwargs["context"], slice(2 * i, 2 * i + 2)
        for name in ("positions", "segments", "whole_segments"):
            assert torch.equal(getattr(part.documents, name), getattr(context.documents, name)[rows])
        assert torch.equal(part.samples.ids, context.samples.ids[rows]) and part.samples.seed == 7
        assert part.documents.masks is not context.documents.masks
        assert torch.equal(part.documents.causal_mask, context.documents.causal_mask[rows])


def test_a_context_is_handed_on_by_keyword_only_when_it_holds_something():
    assert NO_CONTEXT.keywords() == {} and BatchContext().keywords() == {}
    context = BatchContext(samples=Samples.strided(0, 1, 2, seed=7))
    assert context.keywords() == {"context": context}


def test_every_block_s_copy_of_the_documents_shares_their_masks():
    """FSDP2 casts each block's inputs by rebuilding the dataclasses among them: the copies keep one mask and one
    bias per dtype, made once for every layer of a forward."""
    context = packed_rows()
    copy = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, context)
    assert copy is not context and copy.documents is not context.documents
    assert copy.documents.causal_bias(torch.bfloat16) is context.documents.causal_bias(torch.bfloat16)
