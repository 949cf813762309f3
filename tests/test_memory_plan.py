"""What `lit3d plan` plans for a bf16-mixed run against what the run holds, at ZeRO 0, 1 and 3 on 2 ranks, and with
LoRA at DP2 (ZeRO-1, ZeRO-3, ZeRO-3 offloaded) and TP2.

The plan is the search's own `estimate` of the layout (what `lit3d plan` prints and picks by), not the run's. The run
measures its parameters, gradients and optimizer states at the last optimizer step (`memory_by_component`), the bytes
autograd saves in each forward (saved-tensor hooks: the activations, with autocast's bf16 copies of fp32 weights), and
the most bytes of live tensors each rank holds over a whole step (`lit3d.strategies.telemetry.live_memory.PeakMemory`:
what a GPU's allocator would hand out), against the plan's total. A model wide enough for its weights and optimizer
states to dominate, as in a real run; AdamW as PyTorch runs it on GPUs by default (``foreach``: a temporary the size of
what it steps).

ZeRO-0 here is DDP (fp32 parameters, autocast's bf16 copies saved for backward), ZeRO-1 Megatron's distributed
optimizer (bf16 parameters, fp32 master weights in the optimizer's slices), ZeRO-3 FSDP2 (fp32 shards gathered in
bf16).
"""

from dataclasses import asdict
from pathlib import Path

import lightning as L
import pytest
import torch
from layouts import merge

from lit3d import GPTConfig, LoRA
from lit3d.parallel.layout import Layout
from lit3d.parallel.settings import Parallelism
from lit3d.planner import Cluster, Training, estimate
from lit3d.strategies.telemetry.live_memory import PeakMemory

CONFIG = dict(n_layer=2, n_head=6, n_kv_head=2, d_model=384, d_ff=1024, vocab_size=257, max_seq_len=32)
SEQ, BATCH = 16, 8  # 4 sequences per replica: one micro-batch of 64 tokens
STAGES = (0, 1, 3)


class SavedActivations(L.Callback):
    """The most bytes autograd keeps for backward after one forward, each storage once, a DTensor by its local shard.
    Left out: parameters (FSDP2's gathered ones too, which the plan counts as buffers) and the rotary tables
    (computed once, shared by every step)."""

    def __init__(self) -> None:
        self.most, self._seen, self._hooks = 0, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lit3d.models.transformer import rotary_tables

        config = pl_module.config
        tables = [t for dtype in (torch.float32, torch.bfloat16) for t in rotary_tables(
            SEQ, config.head_dim, config.rope_theta, pl_module.device, dtype)]  # fmt: skip
        tables = {_storage(t) for t in tables}
        self._seen = {}

        def pack(tensor):
            # NOTE: the parameters as registered now: FSDP2 registers its gathered ones for the forward
            storage, params = _storage(tensor), {_storage(p) for p in pl_module.parameters()}
            if storage not in tables and storage not in params:
                self._seen[storage] = getattr(tensor, "_local_tensor", tensor).untyped_storage().nbytes()
            return tensor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._hooks.__exit__(None, None, None)
        self.most = max(self.most, sum(self._seen.values()))

    def results(self) -> dict:
        return {"activations": self.most}


def _storage(tensor: torch.Tensor) -> int:
    return getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr()


def planned(
    zero_stage: int, lora: LoRA | None = None, tp: int = 1, offload: bool = False, accumulate: int = 1,
    unsharded: bool = False,
) -> dict[str, int]:  # fmt: skip
    """What `lit3d plan` counts for rank 0 of this run's layout."""
    dp = 2 // tp
    training = Training(seq_len=SEQ, micro_batch_size=BATCH // dp // accumulate, global_batch_size=BATCH,
                        precision="bf16-mixed", lora=lora, accumulate_grad_batches=accumulate)  # fmt: skip
    layout = Layout(dp=dp, tp=tp, pp=1, devices_per_node=2)
    settings = Parallelism(zero_stage=zero_stage, tensor_parallel_size=tp, offload=offload,
                           accumulate_unsharded=unsharded)  # fmt: skip
    cluster = Cluster(nodes=1, gpus_per_node=2)
    return estimate(GPTConfig(**CONFIG), cluster, layout, training, settings).memory_by_stage[0]


# LoRA (rank 16 on every linear, the rest frozen): name -> (strategy, `planned` arguments)
LORA = LoRA(rank=16, alpha=32.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
LORA_RUNS = {
    "lora_dp2_zero1": ({"zero_stage": 1}, dict(zero_stage=1)),
    "lora_dp2_zero3": ({"zero_stage": 3}, dict(zero_stage=3)),
    "lora_tp2": ({"tensor_parallel_size": 2}, dict(zero_stage=1, tp=2)),
    "lora_dp2_zero3_offload": ({"zero_stage": 3, "offload": True}, dict(zero_stage=3, offload=True)),
}


class GradientsBetweenMicroSteps(L.Callback):
    """The bytes of gradients the parameters hold after the first micro-step of an accumulation window."""

    def __init__(self) -> None:
        self.held: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.held is None and trainer.fit_loop._should_accumulate():
            grads = [getattr(p.grad, "_local_tensor", p.grad) for p in pl_module.parameters() if p.grad is not None]
            storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}  # each once
            self.held = sum(storages.values())

    def results(self) -> dict:
        return {"grads_between_micro_steps": self.held}


ACCUMULATE = {"zero3_accumulate4": False, "zero3_accumulate4_unsharded": True}  # name -> accumulate_unsharded


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, dict]:
    """4 steps at each ZeRO stage (3 of 4 micro-steps each when accumulating: step 2 is the one measured); ZeRO-1
    checkpoints after step 2 and is resumed from there."""
    from spawned import run_jobs

    base = dict(
        model=dict(config=CONFIG, learning_rate=3e-3, warmup_steps=2, optimizer_impl="foreach"),
        data=dict(data_path=str(corpus), seq_len=SEQ, global_batch_size=BATCH, val_fraction=0.1),
        trainer=dict(max_steps=4, limit_val_batches=0, precision="bf16-mixed"),
    )
    jobs = {
        f"zero{z}": merge(base, {"strategy": {"zero_stage": z}, "callbacks": [SavedActivations(), PeakMemory(step=2)]})
        for z in STAGES
    }
    jobs["zero1"]["checkpoint_at"] = 2
    for name, unsharded in ACCUMULATE.items():
        jobs[name] = merge(base, {"strategy": {"zero_stage": 3, "accumulate_unsharded": unsharded},
                                  "trainer": {**base["trainer"], "accumulate_grad_batches": 4, "max_steps": 3},
                                  "callbacks": [PeakMemory(step=2), GradientsBetweenMicroSteps()]})  # fmt: skip
    lora = {**asdict(LORA), "targets": list(LORA.targets)}
    for name, (strategy, _) in LORA_RUNS.items():
        jobs[name] = merge(base, {"model": {**base["model"], "lora": lora}, "strategy": strategy,
                                  "callbacks": [SavedActivations(), PeakMemory(step=2)]})  # fmt: skip
    out = Path(tmp_path_factory.mktemp("memory_plan"))
    results = run_jobs(2, jobs, out)
    step2 = out / "zero1" / "ckpts" / "step=2.ckpt"
    resumed = {"zero1_resumed": merge(base, {"strategy": {"zero_stage": 1}, "ckpt_path": str(step2)})}
    return {**results, **run_jobs(2, resumed, out), "step2": step2}


@pytest.mark.parametrize("zero_stage", STAGES)
def test_the_plan_is_what_a_bf16_mixed_run_holds(runs, zero_stage):
    plan = planned(zero_stage)
    for rank, report in enumerate(runs[f"zero{zero_stage}"]["ranks"]):
        measured = {**report["memory"], "activations": report["activations"]}
        assert measured["estimate"] == plan, f"rank {rank}: the run's own estimate is the plan"
        for key in ("params", "grads", "optimizer"):
            assert measured[key] == plan[key], (rank, key, measured[key], plan[key])
        assert measured["activations"] == pytest.approx(plan["activations"], rel=0.05), rank
        keys = ("params", "grads", "optimizer", "activations")
        assert sum(measured[k] for k in keys) == pytest.approx(sum(plan[k] for k in keys), rel=0.05), rank


@pytest.mark.parametrize("zero_stage", STAGES)
def test_the_planned_total_is_the_measured_peak(runs, zero_stage):
    """The most a rank holds at once over a step is the plan's total, within 5 %: ZeRO-0 (DDP) at the optimizer
    step, AdamW's temporary beside every state; ZeRO-1 at backward's end, its bucket's fp32 gradient rows beside the
    reduce-scattered slices; ZeRO-3 in backward, a block's reduce-scatter input beside the gathered parameters."""
    plan = planned(zero_stage)
    for rank, report in enumerate(runs[f"zero{zero_stage}"]["ranks"]):
        assert report["peak_memory"]["peak"] == pytest.approx(plan["total"], rel=0.05), (rank, plan)


def test_the_peak_leaves_out_only_gloos_copy_of_a_reduce_scatter_input(runs):
    """Gloo copies a reduce-scatter's whole input where NCCL reads the caller's buffer: at ZeRO-3, FSDP2's fp32
    gradient of one block (ZeRO-1 sends through an all-to-all, which copies nothing; DDP all-reduces in place)."""
    from lit3d.models.transformer import Transformer

    with torch.device("meta"):
        block = sum(p.numel() for p in Transformer(GPTConfig(**CONFIG)).blocks["0"].parameters())
    copies = {z: max(r["peak_memory"]["collective_copies"] for r in runs[f"zero{z}"]["ranks"]) for z in STAGES}
    assert copies[0] < 64 and copies[1] < 64 and copies[3] == 4 * block, copies


def test_zero1_holds_bf16_weights_and_fp32_master_weights_in_its_slices(runs):
    """Megatron's distributed optimizer: per parameter 2 bytes of bf16 weights, and of a half slice the fp32
    gradient (4) and fp32 master weights and two moments (12): 10 bytes on 2 ranks, against DDP's 16."""
    zero0, zero1 = runs["zero0"]["memory"], runs["zero1"]["memory"]
    assert zero1["params"] * 2 == zero0["params"]
    assert zero1["grads"] * 2 == zero0["grads"]
    steps = zero0["optimizer"] - zero0["params"] * 2  # AdamW's fp32 step counter per tensor
    assert zero1["optimizer"] - steps == pytest.approx(zero0["params"] * 3 / 2, abs=8)


def test_every_stage_trains_as_ddp_does(runs):
    """bf16 weights stepped through fp32 master weights (ZeRO-1) and FSDP2's bf16 gathers (ZeRO-3) follow DDP's
    fp32 weights under autocast: the forward sees the same bf16 values."""
    ddp = runs["zero0"]["losses"]
    for zero_stage in (1, 3):
        losses = runs[f"zero{zero_stage}"]["losses"]
        assert len(losses) == len(ddp) == 4 and ddp[-1] < ddp[0] - 0.5
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ddp)) <= 1e-2, zero_stage


def test_zero1_checkpoints_hold_the_fp32_master_weights_and_resume_exactly(runs):
    from lit3d.checkpoint.folder import read_weights

    assert runs["zero1_resumed"]["losses"] == runs["zero1"]["losses"][2:]  # bit-identical
    weights = read_weights(runs["step2"])["state_dict"]
    up = weights["model.blocks.0.mlp.up_proj.weight"]  # the masters, which bf16 cannot hold, not the bf16 weights
    assert up.dtype == torch.float32 and (up != up.bfloat16().float()).any()


@pytest.mark.parametrize("name", [name for name in LORA_RUNS if "offload" not in name])
def test_the_plan_is_what_a_lora_run_holds_at_dp2_and_tp2(runs, name):
    """LoRA: the frozen weights without gradients or optimizer states, the adapters with both (exact); what autograd
    keeps and the peak of a step, within 5 %."""
    plan = planned(**LORA_RUNS[name][1], lora=LORA)
    for rank, report in enumerate(runs[name]["ranks"]):
        measured = report["memory"]
        assert measured["estimate"] == plan, f"rank {rank}: the run's own estimate is the plan"
        for key in ("params", "grads", "optimizer"):
            assert measured[key] == plan[key], (rank, key, measured[key], plan[key])
        assert report["activations"] == pytest.approx(plan["activations"], rel=0.05), rank
        assert report["peak_memory"]["peak"] == pytest.approx(plan["total"], rel=0.05), (rank, plan)


def test_offload_moves_the_states_to_the_host_memory_the_plan_counts(runs):
    """ZeRO-3 with offload: the device holds none of the states, the host holds what ZeRO-3 would have held. On
    these CPU ranks host and device are one memory, so the measured peak is the planned device peak plus host."""
    offloaded, kept = planned(**LORA_RUNS["lora_dp2_zero3_offload"][1], lora=LORA), planned(3, lora=LORA)
    assert offloaded["params"] == offloaded["grads"] == offloaded["optimizer"] == 0
    assert offloaded["host"] == kept["params"] + kept["grads"] + kept["optimizer"]
    assert offloaded["total"] < kept["total"] - offloaded["host"] / 2
    for report in runs["lora_dp2_zero3_offload"]["ranks"]:
        assert report["memory"]["estimate"] == offloaded
        assert report["peak_memory"]["peak"] == pytest.approx(offloaded["total"] + offloaded["host"], rel=0.05)


def test_zero3_accumulates_sharded_gradients_by_default_and_holds_the_planned_peak_either_way(runs):
    """ZeRO-3 over 4 micro-steps: by default each micro-step reduce-scatters, so a rank holds 1/dp of the gradients
    (4 bytes a parameter over 2 ranks) from the first micro-step on; with ``accumulate_unsharded`` it holds them whole
    until the last. The peak of a step is the plan's total in both modes, within 5 %."""
    from lit3d.models.transformer import Transformer

    with torch.device("meta"):
        elements = sum(p.numel() for p in Transformer(GPTConfig(**CONFIG)).parameters())
    for name, unsharded in ACCUMULATE.items():
        plan = planned(3, accumulate=4, unsharded=unsharded)
        for rank, report in enumerate(runs[name]["ranks"]):
            assert report["memory"]["estimate"] == plan and report["memory"]["grads"] == plan["grads"], (name, rank)
            assert report["peak_memory"]["peak"] == pytest.approx(plan["total"], rel=0.05), (name, rank, plan)
            held = report["grads_between_micro_steps"]
            assert held == (0 if unsharded else pytest.approx(4 * elements / 2, rel=0.01)), (name, rank, held)
    sharded, whole = (planned(3, accumulate=4, unsharded=u)["total"] for u in ACCUMULATE.values())
    peaks = [max(r["peak_memory"]["peak"] for r in runs[name]["ranks"]) for name in ACCUMULATE]
    assert whole > sharded and peaks[1] > peaks[0], (sharded, whole, peaks)
    assert runs["zero3_accumulate4"]["losses"] == pytest.approx(runs["zero3_accumulate4_unsharded"]["losses"], rel=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("reduce", ["float32", "bfloat16"])
def test_the_plan_takes_zero0_for_ddp_exactly_where_the_strategy_runs_ddp(precision, reduce):
    """ZeRO-0 on data parallelism alone is DDP unless bf16-mixed reduces in bf16 (FSDP2's ``replicate``): bf16-true
    reduces in the dtype it holds, so it is DDP, whose buckets (its gradients) are held from backward's start. The
    plan had taken bf16-true for FSDP2 and left the buckets out (1.35x on the suite's tiny model)."""
    from lit3d.parallel.zero import ZeroPolicy
    from lit3d.planner.inputs import held_precision
    from lit3d.planner.memory import params_cast_by_fsdp
    from lit3d.strategies.optim.dtypes import ddp_runs

    settings = Parallelism(zero_stage=0, mixed_precision_reduce=reduce)
    training = Training(seq_len=SEQ, micro_batch_size=BATCH // 2, global_batch_size=BATCH, precision=precision)
    for layout in (Layout(dp=2, tp=1, pp=1, devices_per_node=2), Layout(dp=2, tp=2, pp=1, devices_per_node=4)):
        held = held_precision(training, settings, layout)
        fsdp = params_cast_by_fsdp(layout, ZeroPolicy.of(settings, layout), held)
        assert fsdp == (not ddp_runs(settings, layout, precision)), (layout, held)
