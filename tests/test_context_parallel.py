"""Context parallelism: the chunks, ring attention against whole-sequence attention, layouts against the
single-process curve, bytes against the planner, checkpoints across CP sizes, and the refusals."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from layouts import CP_LAYOUTS, FALLS, HALF, LONG, SMALL_GPT, STEPS, merge

from lit3d import GPTConfig
from lit3d.models import documents
from lit3d.models.ring_attention import ContextParallel, positions, ring_attention, shard_sequence, unshard_sequence
from lit3d.parallel.context import check_context_parallel
from lit3d.parallel.layout import Layout, resolve_layout
from lit3d.parallel.rank_map import rank_map


def test_each_rank_holds_an_early_and_a_late_chunk_at_their_true_positions():
    tokens = torch.arange(16)[None]
    shards = [shard_sequence(tokens, 4, rank) for rank in range(4)]
    assert shards[0].tolist() == [[0, 1, 14, 15]] and shards[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unshard_sequence(shards), tokens)
    assert all(torch.equal(positions(4, 4, rank), shard[0]) for rank, shard in enumerate(shards))


def _ring_worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    errors = {}
    pairs, _ = dist.new_subgroups(2)
    # (the last: latent attention's value heads, narrower than its query and key heads)
    for cp, group, heads, dtype, dv in [(4, dist.group.WORLD, (4, 2), torch.float32, 8),
                                        (2, pairs, (4, 1), torch.float32, 8),
                                        (4, dist.group.WORLD, (4, 4), torch.bfloat16, 8),
                                        (4, dist.group.WORLD, (4, 4), torch.float32, 6)]:  # fmt: skip
        me = dist.get_rank(group)
        (hq, hkv), b, s, d = heads, 2, 8 * cp, 8
        q, g = torch.randn(b, s, hq, d, dtype=dtype), torch.randn(b, s, hq, dv, dtype=dtype)
        k, v = torch.randn(b, s, hkv, d, dtype=dtype), torch.randn(b, s, hkv, dv, dtype=dtype)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in whole), is_causal=True, enable_gqa=hq != hkv
        ).transpose(1, 2)
        expected.backward(g)
        mine = [shard_sequence(t, cp, me).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, ContextParallel(group, cp, me))
        out.backward(shard_sequence(g, cp, me))
        for name, got, want in [("out", out, expected), *zip(("dq", "dk", "dv"), (t.grad for t in mine),
                                                            (t.grad for t in whole))]:  # fmt: skip
            every = [torch.empty_like(got) for _ in range(cp)]
            dist.all_gather(every, got.detach().contiguous(), group=group)
            errors[f"cp{cp} {dtype} v{dv} {name}"] = (unshard_sequence(every).float() - want.float()).abs().max().item()
    errors.update(_packed_documents_errors(rank))
    errors.update(_window_and_sink_errors(rank))
    torch.save(errors, f"{folder}/rank{rank}.pt")
    dist.destroy_process_group()


def _packed_documents_errors(rank: int) -> dict[str, float]:
    """CP4 over rows of packed documents: the ring with document masks against SDPA with the block-diagonal mask."""
    b, s, hq, hkv, d, cp = 2, 32, 4, 2, 8, 4
    q, g = torch.randn(b, s, hq, d), torch.randn(b, s, hq, d)
    k, v = torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    lengths = [[3, 9, 1, 12, 7], [20, 5, 7]]  # across chunk boundaries, and a document of one token
    docs = documents.Documents.of(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = documents.attention_mask(docs.segments, docs.segments, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in whole), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    expected.backward(g)
    mine = [shard_sequence(t, cp, rank).requires_grad_() for t in (q, k, v)]
    share = documents.Documents(*(shard_sequence(t, cp, rank) for t in (docs.positions, docs.segments)),
                                whole_segments=docs.segments)  # fmt: skip
    out = ring_attention(*mine, ContextParallel(dist.group.WORLD, cp, rank), share)
    out.backward(shard_sequence(g, cp, rank))
    errors = {}
    for name, got, want in [("out", out, expected), *zip(("dq", "dk", "dv"), (t.grad for t in mine),
                                                        (t.grad for t in whole))]:  # fmt: skip
        every = [torch.empty_like(got) for _ in range(cp)]
        dist.all_gather(every, got.detach().contiguous())
        errors[f"cp{cp} packed documents {name}"] = (unshard_sequence(every) - want).abs().max().item()
    return errors


def _window_and_sink_errors(rank: int) -> dict[str, float]:
    """CP4 with gpt-oss's and Gemma 3's attention: a window of 6 (across chunk boundaries; a block from rank 0 is out
    of rank 3's sight altogether, and skipped), a sink per head, scores scaled by 0.3, alone and with packed documents:
    the ring against `causal_attention` over the whole sequence, the sinks' gradients summed over the ranks."""
    from lit3d.models.attention import causal_attention

    b, s, hq, hkv, d, cp, window, scale = 2, 32, 4, 2, 8, 4, 6, 0.3
    errors = {}
    for packed in (False, True):
        q, g = torch.randn(b, s, hq, d), torch.randn(b, s, hq, d)
        k, v, sinks = torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d), torch.randn(hq)
        lengths = [[3, 9, 1, 12, 7], [20, 5, 7]]
        docs = documents.Documents.of(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]))
        whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        expected = causal_attention(*whole[:3], "auto", docs if packed else None, window, whole[3], scale)
        expected.backward(g)
        mine = [shard_sequence(t, cp, rank).requires_grad_() for t in (q, k, v)]
        my_sinks = sinks.clone().requires_grad_()
        share = documents.Documents(*(shard_sequence(t, cp, rank) for t in (docs.positions, docs.segments)),
                                    whole_segments=docs.segments) if packed else None  # fmt: skip
        out = ring_attention(*mine, ContextParallel(dist.group.WORLD, cp, rank), share, window, my_sinks, scale)
        out.backward(shard_sequence(g, cp, rank))
        for name, got, want in [("out", out, expected), *zip(("dq", "dk", "dv"), (t.grad for t in mine),
                                                            (t.grad for t in whole))]:  # fmt: skip
            every = [torch.empty_like(got) for _ in range(cp)]
            dist.all_gather(every, got.detach().contiguous())
            errors[f"cp{cp} window sinks packed={packed} {name}"] = (unshard_sequence(every) - want).abs().max().item()
        dist.all_reduce(my_sinks.grad)
        errors[f"cp{cp} window sinks packed={packed} dsinks"] = (my_sinks.grad - whole[3].grad).abs().max().item()
    return errors


@pytest.mark.ranks
def test_ring_attention_equals_whole_sequence_attention_forward_and_backward(tmp_path):
    """Grouped-query heads, value heads narrower than the query heads (latent attention's), CP 2 and 4, fp32 and bf16,
    packed documents, and windows with sinks and a scale of their own: the merged ring equals causal attention over
    the whole sequence (with the documents' mask, the window and the sinks)."""
    from spawned import START_METHOD, free_port

    mp.start_processes(_ring_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method=START_METHOD)
    errors = torch.load(tmp_path / "rank0.pt")
    assert len(errors) == 30
    for name, error in errors.items():
        assert error <= (3e-2 if "bfloat16" in name else 2e-6), (name, error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel: needs a GPU")
def test_the_cuda_kernels_of_the_ring_match_sdpa_on_one_block():
    """The CUDA side of `lit3d.models.ring_attention` (its CPU side runs in every test above): one block's output,
    log-sum-exp and gradients from the flash kernel, against SDPA's autograd."""
    from lit3d.models.ring_attention import _attend, _attend_backward

    q, k, v = (torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = _attend(q.detach(), k.detach(), v.detach(), True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    grads = _attend_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, True)
    assert (out - expected).abs().max() <= 2e-2
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got.float() - want.float()).abs().max() <= 5e-2


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_context_parallel_layout_matches_the_single_process_curve(layout, layout_runs, request):
    """Loss and val loss within 1e-5 of one process; an MoE model's balance loss and load imbalance too (its
    balance loss is per whole sequence, which no CP rank holds alone)."""
    moe = layout.startswith("moe")
    run, reference = (
        layout_runs[layout],
        request.getfixturevalue("reference_long_moe_run" if moe else "reference_long_run"),
    )
    assert len(reference["losses"]) == len(run["losses"]) == STEPS
    assert reference["losses"][-1] < reference["losses"][0] - FALLS
    for key in ("losses", "val_loss", *(("aux_loss", "load_imbalance") if moe else ())):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, key


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_the_ring_and_every_other_axis_send_what_the_planner_counts(layout, layout_runs):
    strategy = CP_LAYOUTS[layout][1]["strategy"]
    comm = layout_runs[layout]["comm_bytes"]
    measured, planned = comm["measured"], comm["planned"]
    assert planned["cp"] > 0
    assert (planned["tp"] > 0) == (strategy.get("tensor_parallel_size", 1) > 1)
    assert (planned["pp"] > 0) == ("pipeline_parallel_size" in strategy)
    uneven = strategy.get("expert_parallel_size", 1) > 1  # the planner counts the all-to-alls for an even load
    for axis in ("tp", "pp", "dp", "cp", *(() if uneven else ("ep",))):
        assert planned[axis] <= measured[axis] <= planned[axis] + 256, (axis, measured, planned)
    if uneven:  # (tests/test_moe.py measures them exactly with every token sent to every expert)
        assert measured["ep"] == pytest.approx(planned["ep"], rel=0.05) and planned["ep"] > 0
    assert measured["other"] <= 64


@pytest.fixture(scope="module")
def cp_saved(base_job, tmp_path_factory) -> dict:
    """Runs checkpointed after step `HALF` at CP2 and on one process, each resumed in the other layout."""
    from spawned import run_jobs

    base = merge(merge(base_job, LONG), {"trainer": {"limit_val_batches": 0}})
    out = tmp_path_factory.mktemp("cp_checkpoints")
    cp2 = {"strategy": {"context_parallel_size": 2}}
    saved = {name: str(out / name / "ckpts" / f"step={HALF}.ckpt") for name in ("cp2", "single")}
    results = run_jobs(1, {
        "single": merge(base, {"strategy": {}, "checkpoint_at": HALF}),
    }, out)  # fmt: skip
    results.update(run_jobs(2, {
        "cp2": merge(base, {**cp2, "checkpoint_at": HALF}),
        "single_resumed_at_cp2": merge(base, {**cp2, "ckpt_path": saved["single"]}),
    }, out))  # fmt: skip
    results.update(run_jobs(1, {"cp2_resumed_on_one": merge(base, {"strategy": {}, "ckpt_path": saved["cp2"]})}, out))
    return results


@pytest.mark.parametrize(("saved", "resumed"), [("cp2", "cp2_resumed_on_one"), ("single", "single_resumed_at_cp2")])
def test_a_checkpoint_resumes_at_another_context_parallel_size(cp_saved, saved, resumed):
    uninterrupted, continued = cp_saved[saved]["losses"], cp_saved[resumed]["losses"]
    assert len(uninterrupted) == STEPS and len(continued) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(continued, uninterrupted[HALF:])) <= 1e-5


def test_bad_context_parallel_settings_are_refused_naming_the_values():
    config = GPTConfig(**SMALL_GPT)
    with pytest.raises(ValueError, match=r"seq_len=100 is not divisible by 2 x context_parallel_size=8"):
        check_context_parallel(4, 100)
    with pytest.raises(ValueError, match=r"24 tokens .* tensor_parallel_size=5"):
        check_context_parallel(2, 48, tp=5, sp=True)
    with pytest.raises(ValueError, match=r"context_parallel_size=3 does not divide the 8 launched ranks"):
        resolve_layout(8, 8, "auto", 1, 1, 1, 3)
    from lit3d import GPT
    from lit3d.strategies import Parallel3DStrategy
    from lit3d.strategies.split.context_parallel import check_module_for_context_parallel

    with pytest.raises(ValueError, match=r"context_parallel_size=0 must be a positive integer"):
        Parallel3DStrategy(context_parallel_size=0)
    with pytest.raises(TypeError, match=r"context_parallel_size=2 needs a module the strategy splits"):
        check_module_for_context_parallel(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match=r"predict with context_parallel_size=1"):
        check_module_for_context_parallel(GPT(config), 2, predicting=True)


def test_context_parallel_sits_between_data_and_tensor_parallel_in_the_rank_map():
    layout = Layout(dp=2, tp=2, pp=2, devices_per_node=8, cp=2)
    assert layout.world_size == 16 and layout.replicas == 4
    assert layout.cp_groups()[0] == [0, 2] and layout.tp_groups()[0] == [0, 1]
    assert all(layout.rank(*layout.coordinate(r)) == r for r in range(16))
    text = rank_map(layout)
    assert "dp 2 x cp 2 x tp 2 x pp 2" in text and "context-parallel ring of 2 (stride 2)" in text
    assert "(p, d, c, t)" in text and "   0     6  (0, 1, 1, 0)" in text


def test_the_planner_needs_context_parallelism_for_llama_405b_at_128k_tokens(capsys):
    """16,384 H100s, 128k-token sequences: without CP only pipelines of one or two micro-batches per replica fit,
    idling a third or more of the step; the search (TP8 in both) picks a layout with CP, twice as fast, and says
    why."""
    from lit3d.cli import main
    from lit3d.planner import Cluster, Training, search

    llama, training = GPTConfig.from_name("llama-405b"), Training(seq_len=131072, global_batch_size=2048)
    without, dropped = search(llama, Cluster(nodes=2048), training, context_parallel_size=1, tensor_parallel_size=8)
    assert dropped["out_of_memory"] > 0 and all(c.plan.pipeline_bubble >= 1 / 3 for c in without)
    main(
        [
            "plan",
            "--model",
            "llama-405b",
            "--seq_len",
            "131072",
            "--nodes",
            "2048",
            "--global_batch_size",
            "2048",
            "--top",
            "1",
            "--tensor_parallel_size",
            "8",
        ]
    )  # fmt: skip (TP8 in both: a fourth of the search's time)
    text = capsys.readouterr().out
    header, best = (line.split() for line in text.splitlines()[2:4])
    assert header[:3] == ["#", "dp", "cp"] and int(best[2]) > 1, text
    assert header[-3:] == ["step", "s", "MFU"] and float(best[-2]) < min(c.plan.step_time_s for c in without) / 2
    assert "tokens per rank, its ring moves" in text and f"--trainer.strategy.context_parallel_size={best[2]} " in text
