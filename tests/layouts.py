"""The layouts the strategy tests train (one spawn per world size runs them all: `conftest.layout_runs`), the small
models they train and `merge`, which lays a job's overrides over the shared job."""

import lightning as L
import torch

from lit3d.callbacks import CommReport

# Grouped-query heads, and a vocabulary of 257 (padded to 320) that no TP size divides. Two blocks: a layout run's
# time grows with its blocks (18 jobs of 4 ranks took 140 core-s with 4, 106 with 2); the jobs of 4 stages (pp4,
# virtual stages, the V-shaped schedules) train DEEP_GPT's 4, against its own single-process run.
SMALL_GPT = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32)
DEEP_GPT = dict(SMALL_GPT, n_layer=4)
DEEP = {"model": {"config": DEEP_GPT}}


def is_deep(job: dict) -> bool:
    """Whether ``job`` (a layout's overrides) trains `DEEP_GPT`, so compares with the deep single-process run."""
    return job.get("model", {}).get("config") is DEEP_GPT


def pp(size: int, schedule: str = "1f1b", **more) -> dict:
    return {"pipeline_parallel_size": size, "pipeline_schedule": schedule, **more}


# Every job (`conftest.base_job`) trains STEPS steps with gradient clipping active and validates after the last; a
# job that another resumes saves at step HALF; those that measure the bytes each axis sends (`CommReport`) measure
# step COMMS_STEP, after the first step's one-off collectives. (Three steps: the first update, one with optimizer
# states, and one after a resume's; each step of a layout run costs about 0.3 s of both cores.)
STEPS = 3
HALF = STEPS // 2
COMMS_STEP = HALF + 1
VAL_BATCHES = 1  # validated on, after the last step
FALLS = 0.3  # the least the single-process loss falls over STEPS steps, that a comparison is of a run that learns
# Two micro-steps per step, validating after the same optimizer step as the others (Lightning's interval counts
# micro-batches): otherwise a validation would come before a step, and ZeRO-2 would start it with the parameters
# validation's forward left gathered, so `CommReport` would find no step with its all-gather.
ACCUMULATE2 = {"accumulate_grad_batches": 2, "val_check_interval": 2 * STEPS}


def saved_at_half(job: str) -> str:
    """The ``ckpt_path`` of the checkpoint ``job`` saves at step `HALF` (``"checkpoint_at": HALF``) for a job of the
    same spawn to resume (`spawned.run_job` reads ``job:``)."""
    return f"job:{job}/ckpts/step={HALF}.ckpt"


# name -> (world size, job overrides), fp32 unless a job says otherwise. Those in COMM_MEASURED measure their bytes.
LAYOUTS: dict[str, tuple[int, dict]] = {
    "dp2_zero0": (2, {"strategy": {"zero_stage": 0}}),
    "dp2_zero1": (2, {"strategy": {"zero_stage": 1}}),
    "dp2_zero2": (2, {"strategy": {"zero_stage": 2}}),
    "dp2_zero3": (2, {"strategy": {"zero_stage": 3}}),
    "tp2": (2, {"strategy": {"tensor_parallel_size": 2}}),
    "tp2_sequence_parallel": (2, {"strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}}),
    "tp2_selective_recompute": (2, {"strategy": {"tensor_parallel_size": 2, "activation_checkpointing": "selective"}}),
    "dp2_zero3_full_recompute": (2, {"strategy": {"zero_stage": 3, "activation_checkpointing": "full"}}),
    "dp2_zero2_accumulate2": (2, {"strategy": {"zero_stage": 2}, "trainer": ACCUMULATE2}),
    "dp2_zero3_accumulate2": (2, {"strategy": {"zero_stage": 3}, "trainer": ACCUMULATE2}),
    "dp2_zero3_accumulate2_unsharded": (
        2,
        {"strategy": {"zero_stage": 3, "accumulate_unsharded": True}, "trainer": ACCUMULATE2},
    ),
    "dp2_zero0_unseeded": (2, {"strategy": {"zero_stage": 0}, "unseeded": True, "trainer": {"max_steps": 2}}),
    **{
        f"dp2_zero{z}_accumulate2_comms": (
            2,
            {
                "strategy": {"zero_stage": z},
                "count_comms": True,
                "trainer": {**ACCUMULATE2, "max_steps": 2},
            },
        )
        for z in (0, 1)
    },
    **{
        f"dp2_zero{z}_bf16-true": (
            2,
            {"strategy": {"zero_stage": z}, "trainer": {"precision": "bf16-true"}},
        )
        for z in (0, 3)
    },
    **{  # compared with the single-process bf16-mixed run
        f"{name}_bf16-mixed{suffix}": (
            world,
            {"strategy": strategy, "trainer": {"precision": "bf16-mixed"}, "callbacks": [CommReport(step=COMMS_STEP)]},
        )
        for name, suffix, world, strategy in [
            *((f"dp2_zero{z}", "", 2, {"zero_stage": z}) for z in (0, 1, 3)),
            ("dp2_zero3", "_reduce_bf16", 2, {"zero_stage": 3, "mixed_precision_reduce": "bfloat16"}),
            ("dp2_zero0", "_reduce_bf16", 2, {"zero_stage": 0, "mixed_precision_reduce": "bfloat16"}),
            ("tp2_sequence_parallel", "", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
            ("pp2_1f1b", "", 2, pp(2)),
            ("dp2_tp2_zero3", "", 4, {"tensor_parallel_size": 2, "zero_stage": 3}),
        ]
    },
    "pp2_gpipe": (2, {"strategy": pp(2, "gpipe")}),
    "pp2_1f1b": (2, {"strategy": pp(2)}),
    "pp2_interleaved_1f1b": (2, {**DEEP, "strategy": pp(2, "interleaved_1f1b", virtual_pipeline_size=2)}),
    "pp2_zero_bubble": (2, {**DEEP, "strategy": pp(2, "zero_bubble", virtual_pipeline_size=2)}),
    # The V-shaped schedules (two chunks per rank, stages r and 2p-1-r): alone, under full recompute, and on all
    # three axes with ZeRO and selective recompute.
    "pp2_zbv": (2, {**DEEP, "strategy": pp(2, "zbv")}),
    "pp2_dualpipev_full_recompute": (2, {**DEEP, "strategy": pp(2, "dualpipev", activation_checkpointing="full")}),
    "pp2_1f1b_accumulate2": (2, {"strategy": pp(2), "trainer": ACCUMULATE2}),
    "pp2_1f1b_loss_scaled": (2, {"strategy": pp(2), "loss_scale": 1024.0}),
    "dp2_pp2_zero1_accumulate2": (4, {"strategy": pp(2, zero_stage=1), "trainer": ACCUMULATE2}),
    "pp4_1f1b": (4, {**DEEP, "strategy": pp(4)}),
    "dp2_pp2_zero3": (4, {"strategy": pp(2, zero_stage=3)}),
    "tp2_pp2_sequence_parallel": (4, {"strategy": pp(2, tensor_parallel_size=2, sequence_parallel=True)}),
    "dp2_tp2_pp2_zero1": (
        8,
        {"strategy": pp(2, tensor_parallel_size=2, zero_stage=1), "checkpoint_every": STEPS, "test_after_fit": True},
    ),
    "dp2_pp2_zbv_zero1": (4, {**DEEP, "strategy": pp(2, "zbv", zero_stage=1)}),
    "dp2_pp2_dualpipev_zero2_selective_recompute": (
        4,
        {**DEEP, "strategy": pp(2, "dualpipev", zero_stage=2, activation_checkpointing="selective")},
    ),
    "dp2_tp2_zero1": (4, {"strategy": {"tensor_parallel_size": 2, "zero_stage": 1}}),
    "dp2_tp2_zero3": (4, {"strategy": {"tensor_parallel_size": 2, "zero_stage": 3}}),
    "dp2_zero1_plan_profile": (2, {"strategy": {"zero_stage": 1, "plan_profile": "CPU_PROFILE"}}),
    "dp2_tp2_plain_loader": (
        4,
        {"strategy": {"tensor_parallel_size": 2}, "plain_loader": True, "trainer": {"max_steps": 2}},
    ),
}


# Mixture of Experts: 4 experts, 2 per token, after one dense block; compared with its own single-process run.
SMALL_MOE = dict(SMALL_GPT, n_expert=4, n_expert_per_token=2, d_ff_expert=48, first_dense_layers=1)
MOE_LAYOUTS = {
    name: (world, {"model": {"config": SMALL_MOE}, "strategy": strategy})
    for name, world, strategy in [
        ("moe_ep2", 2, {"expert_parallel_size": 2}),
        ("moe_tp2_sequence_parallel", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
        ("moe_ep2_selective_recompute", 2, {"expert_parallel_size": 2, "activation_checkpointing": "selective"}),
        # (Dynamo's graph around the eager MoE layer is what is checked: AOTAutograd without inductor's C++ kernels,
        # which cost half a minute of both cores on a machine that has not compiled them before)
        ("moe_ep2_compile", 2, {"expert_parallel_size": 2, "compile": "aot_eager"}),
        ("moe_dp4_ep2", 4, {"expert_parallel_size": 2}),
        ("moe_ep2_zero3", 2, {"expert_parallel_size": 2, "zero_stage": 3}),
        ("moe_dp4_ep2_zero3", 4, {"expert_parallel_size": 2, "zero_stage": 3}),
        # HSDP: dense shards in groups of 2 (summed across them), experts over the ranks that hold them
        ("moe_dp4_ep2_shard2_zero1", 4, {"expert_parallel_size": 2, "data_parallel_shard_size": 2}),
        ("moe_pp2", 2, {"pipeline_parallel_size": 2}),
        ("moe_ep2_pp2", 4, {"expert_parallel_size": 2, "pipeline_parallel_size": 2}),
        ("moe_ep2_tp2_sequence_parallel", 4, {"expert_parallel_size": 2, "tensor_parallel_size": 2,
                                               "sequence_parallel": True}),
    ]
}  # fmt: skip
# Every token to every expert: an even load, so the all-to-alls send exactly what the planner counts.
MOE_LAYOUTS["moe_dp2_ep2_tp2_sequence_parallel_comms"] = (4, {
    "model": {"config": dict(SMALL_MOE, n_expert_per_token=SMALL_MOE["n_expert"])},
    "strategy": {"expert_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
    "callbacks": [CommReport(step=COMMS_STEP)],
})  # fmt: skip


# Context parallelism: sequences of 256 tokens (2 x cp chunks each), compared with their own single-process run;
# every layout also measures its bytes per axis.
LONG = {"model": {"config": dict(SMALL_GPT, max_seq_len=256)}, "data": {"seq_len": 256, "global_batch_size": 4}}
CP_LAYOUTS = {
    name: (world, {**LONG, "strategy": strategy, "callbacks": [CommReport(step=COMMS_STEP)]})
    for name, world, strategy in [
        ("cp2", 2, {"context_parallel_size": 2}),
        ("cp4", 4, {"context_parallel_size": 4}),
        ("cp2_tp2_sequence_parallel", 4, {"context_parallel_size": 2, "tensor_parallel_size": 2,
                                          "sequence_parallel": True}),
        ("dp2_cp2_zero3", 4, {"context_parallel_size": 2, "zero_stage": 3}),
        ("cp2_pp2", 4, {"context_parallel_size": 2, **pp(2)}),
        ("cp2_full_recompute", 2, {"context_parallel_size": 2, "activation_checkpointing": "full"}),
        ("cp2_selective_recompute", 2, {"context_parallel_size": 2, "activation_checkpointing": "selective"}),
    ]
}  # fmt: skip
LONG_MOE = {**LONG, "model": {"config": dict(SMALL_MOE, max_seq_len=256)}}
CP_LAYOUTS.update({
    name: (world, {**LONG_MOE, "strategy": strategy, "callbacks": [CommReport(step=COMMS_STEP)]})
    for name, world, strategy in [
        ("moe_cp2", 2, {"context_parallel_size": 2}),
        ("moe_dp2_ep2_cp2", 4, {"context_parallel_size": 2, "expert_parallel_size": 2}),
    ]
})  # fmt: skip


class OffloadProbe(L.Callback):
    """Records the offload policy of every FSDP2 unit and where the optimizer keeps its states after a step."""

    def __init__(self) -> None:
        self.policies, self.state_devices = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        self.policies = sorted({type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__ for m in units
                                if m._get_fsdp_state()._fsdp_param_group is not None})  # fmt: skip
        states = trainer.optimizers[0].state.values()
        self.state_devices = sorted({str(t.device) for s in states for t in s.values() if torch.is_tensor(t)})

    def results(self) -> dict:
        return {"offload_policies": self.policies, "optimizer_state_devices": self.state_devices}


# LoRA on every linear of the blocks, every other weight frozen, with dropout on the adapters' inputs (its masks are the
# same in every layout: `lit3d.models.lora_dropout`), compared with its own single-process run. Adapters start at zero
# and train at a higher rate than whole models (at 1e-2 the MoE model's loss did not fall in `STEPS` steps).
LORA_RATE = 3e-2
LORA = {
    "model": {
        "learning_rate": LORA_RATE,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q", "k", "v", "o", "gate", "up", "down"]},
    }
}
LORA_LAYOUTS = {
    name: (world, {**LORA, "strategy": strategy})
    for name, world, strategy in [
        ("lora_dp2_zero0", 2, {"zero_stage": 0}),
        ("lora_dp2_zero3", 2, {"zero_stage": 3}),
        ("lora_tp2", 2, {"tensor_parallel_size": 2}),
        ("lora_tp2_sequence_parallel", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
        ("lora_pp2_resumed_from_tp2", 2, pp(2)),
        ("lora_pp2", 2, pp(2)),
        ("lora_dp2_pp2_zero1_full_recompute_accumulate2", 4, {"zero_stage": 1, "activation_checkpointing": "full",
                                                               **pp(2)}),
        ("lora_dp2_tp2_zero3", 4, {"tensor_parallel_size": 2, "zero_stage": 3}),
    ]
}  # fmt: skip
# An MoE model with adapters on its attention and on each expert, the experts (and their adapters) split over EP.
LORA_MOE = {
    "model": {
        "config": SMALL_MOE,
        "learning_rate": LORA_RATE,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q", "v", "gate", "down"]},
    }
}
LORA_LAYOUTS["lora_moe_ep2"] = (2, {**LORA_MOE, "strategy": {"expert_parallel_size": 2}})
# Four stages in a V: the adapters on the deep model.
LORA_DEEP = {"model": {**LORA["model"], "config": DEEP_GPT}}
LORA_LAYOUTS["lora_pp2_zbv"] = (2, {**LORA_DEEP, "strategy": pp(2, "zbv")})
# Context parallelism: the adapters on sequences of 256 tokens, split over 2 ranks.
LORA_LONG = {**LONG, "model": {**LONG["model"], **LORA["model"]}}
LORA_LAYOUTS["lora_cp2"] = (2, {**LORA_LONG, "strategy": {"context_parallel_size": 2}})
LORA_LAYOUTS["lora_dp2_zero3_offload"] = (2, {**LORA, "strategy": {"zero_stage": 3, "offload": True},
                                             "callbacks": [OffloadProbe()]})  # fmt: skip
LORA_LAYOUTS["lora_dp2_pp2_zero1_full_recompute_accumulate2"][1]["trainer"] = ACCUMULATE2
LORA_LAYOUTS["lora_tp2"][1]["checkpoint_at"] = HALF
LORA_LAYOUTS["lora_pp2_resumed_from_tp2"][1]["ckpt_path"] = saved_at_half("lora_tp2")


# Chat data (answers of 1 to 200 tokens, prompts masked) packed into 256-token rows, and short documents packed with
# document masking: each compared with its own single-process run.
CHAT_GPT = dict(SMALL_GPT, vocab_size=320, max_seq_len=256)
CHAT = {"data_class": "chat", "model": {"config": CHAT_GPT}}
DOCUMENTS = {**LONG, "data": {**LONG["data"], "document_masking": True}}
PACKED_LAYOUTS = {
    "chat_dp2": (2, {**CHAT, "strategy": {}}),
    "chat_pp2_4_microbatches": (2, {**CHAT, "strategy": pp(2, num_microbatches=4)}),
    "chat_cp2": (2, {**CHAT, "strategy": {"context_parallel_size": 2}}),
    "chat_tp2_sequence_parallel": (2, {**CHAT, "strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}}),
    "documents_cp2": (2, {**DOCUMENTS, "strategy": {"context_parallel_size": 2}}),
    "documents_pp2": (2, {**DOCUMENTS, "strategy": pp(2, num_microbatches=2)}),
}


COMM_MEASURED = [
    "dp2_zero0",
    "dp2_zero1",
    "dp2_zero2",
    "dp2_zero3",
    "dp2_zero2_accumulate2",
    "dp2_zero3_accumulate2",
    "dp2_zero3_accumulate2_unsharded",
    "dp2_zero3_full_recompute",
    "tp2",
    "tp2_sequence_parallel",
    "tp2_selective_recompute",
    "pp2_interleaved_1f1b",
    "pp4_1f1b",
    "pp2_1f1b_accumulate2",
    "dp2_pp2_zero3",
    "dp2_pp2_zero1_accumulate2",
    "tp2_pp2_sequence_parallel",
    "dp2_tp2_pp2_zero1",
    "dp2_tp2_zero3",
]
for _name in COMM_MEASURED:
    LAYOUTS[_name][1]["callbacks"] = [CommReport(step=COMMS_STEP)]
for _name in ["dp2_zero0", "dp2_zero3", "tp2", "pp2_1f1b", "dp2_tp2_pp2_zero1"]:
    LAYOUTS[_name][1]["validate_after_fit"] = True


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out
