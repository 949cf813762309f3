"""Combinations of settings (`benchmarks/combinations.py`): a few fixed draws train like one process or are refused
before any rank starts, in one line naming the settings; and packed documents under recompute in a pipeline, the
combination that once crashed in step 0 (the recomputed forward saw the whole batch's documents, not its
micro-batch's), trains like one process in every schedule and with context parallelism."""

import random
from pathlib import Path

import pytest
import torch
from layouts import DEEP_GPT
from turns import ranks_turn

from benchmarks.combinations import Draw, compare, draw, job_of, reference_of, refusal, train, write_corpus
from benchmarks.rank_group import run_group
from lit3d import GPT, GPTConfig
from lit3d.models.batch_context import BatchContext
from lit3d.models.documents import Documents
from lit3d.strategies.split.recompute import apply_activation_checkpointing

MODEL = dict(DEEP_GPT, max_seq_len=64)  # 4 blocks: draws of 4 stages (virtual stages, V shapes)
STEPS = 3


def pp2(schedule: str, recompute: str, **more) -> dict:
    return {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, "activation_checkpointing": recompute, **more}


# Document masks under recompute in a pipeline: each schedule and each kind of recompute, and with CP2.
RECOMPUTED_DOCUMENTS = {
    f"pp2_{schedule}_{recompute}": Draw(0, 2, pp2(schedule, recompute), documents=True)
    for schedule, recompute in (("1f1b", "full"), ("interleaved_1f1b", "selective"), ("zbv", "full"))
}
RECOMPUTED_DOCUMENTS["cp2_pp2_zbv_selective"] = Draw(
    0, 4, pp2("zbv", "selective", context_parallel_size=2), documents=True
)

# Draws of the sweep, fixed: every axis and most features, a few at a time (the first two once failed: an uneven
# replica's MoE balance term was not weighted by its share; selective recompute reran FSDP2's bf16 input casts; the
# last is Muon at ZeRO-1, each stack of experts sliced along its experts).
DRAWS = {
    "dp2_ep2_zero2_selective_shares_moe_documents": Draw(
        0, 2, {"data_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 2,
               "activation_checkpointing": "selective", "data_parallel_shares": [12, 4]},
        accumulate=2, clip=0.5, moe=True, documents=True),
    "dp2_zero3_selective_bf16": Draw(
        0, 2, {"data_parallel_size": 2, "zero_stage": 3, "activation_checkpointing": "selective"},
        precision="bf16-mixed", clip=0.5),
    "cp2_zero3_full_lora_documents": Draw(
        0, 2, {"context_parallel_size": 2, "zero_stage": 3, "activation_checkpointing": "full"},
        clip=0.5, lora=True, documents=True),
    "dp2_pp2_interleaved_zero1_shares_moe_muon": Draw(
        0, 4, {"data_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b",
               "num_microbatches": 2, "data_parallel_shares": [12, 4]},
        accumulate=2, moe=True, muon=True),
}  # fmt: skip

# Draws the checks refuse, and the settings each refusal must name.
REFUSED = [
    (Draw(0, 4, pp2("zbv", False, data_parallel_size=2, zero_stage=3)), ("zero_stage=3", "pipeline_schedule='zbv'")),
    (Draw(0, 2, {"data_parallel_size": 2, "expert_parallel_size": 2}), ("expert_parallel_size=2", "n_expert=0")),
    (Draw(0, 2, {"data_parallel_size": 2, "float8": "tensorwise"}), ("float8='tensorwise'", "precision='32-true'")),
    (Draw(0, 4, {"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 0,
                 "activation_checkpointing": "selective"}, moe=True),
     ("activation_checkpointing='selective'", "expert_parallel_size=2", "zero_stage=0")),
    (Draw(0, 8, pp2("1f1b", "selective", data_parallel_size=4, expert_parallel_size=2, zero_stage=2), moe=True),
     ("activation_checkpointing='selective'", "expert_parallel_size=2", "pipeline_parallel_size=2", "zero_stage=2")),
    (Draw(0, 8, {"data_parallel_size": 4, "tensor_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 2,
                 "activation_checkpointing": "selective"}, moe=True),  # (the sweep's draw 33 of seed 1, which failed)
     ("activation_checkpointing='selective'", "expert_parallel_size=2", "zero_stage=2")),
]  # fmt: skip


def run(job: dict, job_dir, world: int) -> dict:
    """The ranks' runner: `train`, or a failure on the last rank for a job that asks for one."""
    import torch.distributed as dist

    if job.get("fail") and dist.get_rank() == world - 1:
        raise ValueError("this rank failed on purpose")
    with ranks_turn(f"combinations/{Path(job_dir).name} ({world} ranks)"):  # (one group at a time: `turns`)
        return train(job, job_dir, world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every draw above (and one that fails) in one spawn per world size, and one process's run of each."""
    out = tmp_path_factory.mktemp("combinations")
    corpus = write_corpus(out / "corpus.jsonl")
    draws = {**RECOMPUTED_DOCUMENTS, **DRAWS}
    jobs = {name: job_of(d, corpus, STEPS, MODEL) for name, d in draws.items()}
    for name, job in jobs.items():
        assert refusal(job, draws[name].world) is None, name
    one_process = {}  # one process's run of each job (the draws of the same model, data and loop share one)
    for job in jobs.values():
        one_process.setdefault(repr(reference_of(job)), reference_of(job))
    groups = {1: {f"one_process{i}": job for i, job in enumerate(one_process.values())}}
    for world in (2, 4):
        groups[world] = {name: job for name, job in jobs.items() if draws[name].world == world}
    groups[2]["fails"] = {**jobs["pp2_1f1b_full"], "fail": True}  # last: the group ends with it
    results = {}
    for world, group in groups.items():
        results[world] = run_group(world, group, "test_combinations:run", out / f"world{world}", job_timeout=300)
    references = dict(zip(one_process, results.pop(1).values()))
    runs = {name: result for group in results.values() for name, result in group.items()}
    for name, job in jobs.items():
        runs[name]["one_process"] = references[repr(reference_of(job))]
    return draws, runs


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_recomputed_block_sees_the_documents_its_forward_saw(recompute):
    """Backward runs after the caller has moved on (a pipeline's next micro-batch, or PyTorch's shape inference of a
    stage, which back-propagates through micro-batch 0): the recomputation runs with its forward's arguments, the
    batch's context among them, and the gradients are those of a block that kept its activations."""
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.cat([torch.arange(5), torch.arange(11)]).repeat(2, 1)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(1)
        model = GPT(config)
        model.configure_model()
        if checkpointed:
            apply_activation_checkpointing(list(model.model.blocks.values()), recompute)
        logits = model.model(tokens, context=BatchContext(Documents.of(positions)))
        model.model(tokens[:1])  # the caller moves on: another forward, of other rows and no documents
        logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", RECOMPUTED_DOCUMENTS)
def test_document_masks_under_recompute_in_a_pipeline_train_like_one_process(name, runs):
    draws, results = runs
    d = draws[name]
    compare(d, results[name], results[name]["one_process"], STEPS)
    assert d.outcome == "exact", d.detail  # fp32: every step's loss and the validation loss within 1e-5 relative


@pytest.mark.parametrize("name", DRAWS)
def test_fixed_draws_train_like_one_process(name, runs):
    draws, results = runs
    d = draws[name]
    compare(d, results[name], results[name]["one_process"], STEPS)
    assert d.outcome == "exact", d.detail


def test_a_rank_that_fails_is_reported_with_its_error_in_one_line(runs):
    _, results = runs
    assert results["fails"]["error"].startswith("ValueError: this rank failed on purpose (test_combinations.py:")


@pytest.mark.parametrize("refused, names", REFUSED, ids=lambda v: v.layout() if isinstance(v, Draw) else "")
def test_refused_draws_are_refused_before_start_in_one_line_naming_the_settings(refused, names, tmp_path):
    outcome = refusal(job_of(refused, write_corpus(tmp_path / "corpus.jsonl"), STEPS, MODEL), refused.world)
    assert outcome is not None and outcome[0] == "refused", outcome
    assert "\n" not in outcome[1] and all(name in outcome[1] for name in names), outcome[1]


def test_the_same_seed_draws_the_same_combinations_within_the_ranks_allowed():
    first, again = random.Random(7), random.Random(7)
    draws = [draw(first, i, max_ranks=4) for i in range(20)]
    assert [d.layout() for d in draws] == [draw(again, i, max_ranks=4).layout() for i in range(20)]
    assert len({d.layout() for d in draws}) > 15 and all(d.world <= 4 for d in draws)


def test_muons_layouts_are_each_a_layout_its_checks_accept_before_any_rank_starts(tmp_path):
    """`--muon-layouts`: Muon in each layout docs/muon.md quotes (trained 8 steps against one process there); here
    only drawn and checked as `lit3d fit` checks them (no rank started)."""
    from benchmarks.combination_draws import muon_layouts

    draws = muon_layouts()
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    assert all(d.muon for d in draws) and {d.world for d in draws} == {2, 4, 8}
    assert [refusal(job_of(d, corpus, STEPS, MODEL), d.world) for d in draws] == [None] * len(draws)
    layouts = [d.layout() for d in draws]
    assert "DP4 ZeRO-3 HSDP shard groups of 2" in layouts and "DP2 TP2 PP2 1f1b ZeRO-1" in layouts
