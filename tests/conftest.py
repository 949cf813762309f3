import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lit3d import GPTConfig
from lit3d.callbacks import CommReport

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def pytest_collection_modifyitems(config, items):
    # NOTE: `layout_runs` spawns every layout once for the session (10-12 minutes on 2 cores beside the other xdist
    # worker); the first test that asks for it pays for that, so tests that use it get a longer limit than the
    # suite's 300 s.
    for item in items:
        if "layout_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1800))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; its CPU counterpart runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (``-n 2``): each file's tests on one worker, so its module-scoped fixtures are made once, and every
    file that reads `layout_runs` on the same worker, so its spawn runs once.

    NOTE: not ``--dist loadgroup`` with ``xdist_group`` marks: under pytest 9.2 (which reads a node's id from ``_id``)
    xdist's rewrite of ``_nodeid`` groups nothing. `_split_scope` is the method xdist's own `LoadFileScheduling`
    overrides."""
    from xdist.scheduler import LoadScopeScheduling

    tests = Path(__file__).parent
    shared = {f"{tests.name}/{p.name}" for p in tests.glob("test_*.py") if "layout_runs" in p.read_text()}

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "layout_runs" if path in shared else path

    return FileScheduling(config, log)


# A run in this process (Lightning under Parallel3DStrategy, in a test or a shared fixture) sets these and keeps its
# process group, whose store holds MASTER_PORT: a command a test starts must not inherit them. Once a process group
# exists, Lightning does not read them again, so every test starts without them.
LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def no_launch_environment():
    for key in LAUNCH_ENVIRONMENT:
        os.environ.pop(key, None)
    yield


@pytest.fixture
def small_config() -> GPTConfig:
    """Small enough for fast CPU tests, with grouped-query heads."""
    return GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=256, max_seq_len=64)


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of a few small text documents."""
    import random

    words = random.Random(0).choices(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"], k=6 * 400)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        target = folder / ("sub" if i % 2 else "") / f"doc{i}.txt"
        target.write_text(" ".join(words[i * 400 : (i + 1) * 400]) + "\n")
    return folder


# ---------------------------------------------------------------- multi-rank runs, shared by the strategy tests

# Grouped-query heads, and a vocabulary of 257 (padded to 320) that no TP size divides; 4 blocks for 4 stages.
SMALL_GPT = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32)


def pp(size: int, schedule: str = "1f1b", **more) -> dict:
    return {"pipeline_parallel_size": size, "pipeline_schedule": schedule, **more}


# name -> (world size, job overrides); every job trains 8 fp32 steps with gradient clipping active and
# validates after steps 4 and 8. Those in COMM_MEASURED also measure the bytes each axis sends in step 5.
LAYOUTS: dict[str, tuple[int, dict]] = {
    "dp2_zero0": (2, {"strategy": {"zero_stage": 0}}),
    "dp2_zero1": (2, {"strategy": {"zero_stage": 1}}),
    "dp2_zero2": (2, {"strategy": {"zero_stage": 2}}),
    "dp2_zero3": (2, {"strategy": {"zero_stage": 3}}),
    "tp2": (2, {"strategy": {"tensor_parallel_size": 2}}),
    "tp2_sequence_parallel": (2, {"strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}}),
    "tp2_selective_recompute": (2, {"strategy": {"tensor_parallel_size": 2, "activation_checkpointing": "selective"}}),
    "dp2_zero3_full_recompute": (2, {"strategy": {"zero_stage": 3, "activation_checkpointing": "full"}}),
    "dp2_zero0_accumulate2": (2, {"strategy": {"zero_stage": 0}, "trainer": {"accumulate_grad_batches": 2}}),
    "dp2_zero1_accumulate2": (2, {"strategy": {"zero_stage": 1}, "trainer": {"accumulate_grad_batches": 2}}),
    "dp2_zero2_accumulate2": (2, {"strategy": {"zero_stage": 2}, "trainer": {"accumulate_grad_batches": 2}}),
    "dp2_zero3_accumulate2": (2, {"strategy": {"zero_stage": 3}, "trainer": {"accumulate_grad_batches": 2}}),
    "dp2_zero3_accumulate2_unsharded": (
        2,
        {"strategy": {"zero_stage": 3, "accumulate_unsharded": True}, "trainer": {"accumulate_grad_batches": 2}},
    ),
    "dp2_zero0_unseeded": (2, {"strategy": {"zero_stage": 0}, "unseeded": True, "trainer": {"max_steps": 2}}),
    **{
        f"dp2_zero{z}_accumulate2_comms": (
            2,
            {
                "strategy": {"zero_stage": z},
                "count_comms": True,
                "trainer": {"accumulate_grad_batches": 2, "max_steps": 2},
            },
        )
        for z in (0, 1)
    },
    **{
        f"dp2_zero{z}_bf16-true": (
            2,
            {"strategy": {"zero_stage": z}, "trainer": {"precision": "bf16-true", "max_steps": 4}},
        )
        for z in range(4)
    },
    **{  # 12 steps, compared with the single-process bf16-mixed run; CommReport measures step 5
        f"{name}_bf16-mixed{suffix}": (
            world,
            {
                "strategy": strategy,
                "trainer": {"precision": "bf16-mixed", "max_steps": 12, "val_check_interval": 6},
                "callbacks": [CommReport(step=5)],
            },
        )
        for name, suffix, world, strategy in [
            *((f"dp2_zero{z}", "", 2, {"zero_stage": z}) for z in range(4)),
            ("dp2_zero3", "_reduce_bf16", 2, {"zero_stage": 3, "mixed_precision_reduce": "bfloat16"}),
            ("dp2_zero0", "_reduce_bf16", 2, {"zero_stage": 0, "mixed_precision_reduce": "bfloat16"}),
            ("tp2_sequence_parallel", "", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
            ("pp2_1f1b", "", 2, pp(2)),
            ("dp2_tp2_zero3", "", 4, {"tensor_parallel_size": 2, "zero_stage": 3}),
        ]
    },
    "pp2_gpipe": (2, {"strategy": pp(2, "gpipe")}),
    "pp2_1f1b": (2, {"strategy": pp(2)}),
    "pp2_interleaved_1f1b": (2, {"strategy": pp(2, "interleaved_1f1b", virtual_pipeline_size=2)}),
    "pp2_zero_bubble": (2, {"strategy": pp(2, "zero_bubble", virtual_pipeline_size=2)}),
    # The V-shaped schedules (two chunks per rank, stages r and 2p-1-r): alone, under full recompute, and on all
    # three axes with ZeRO and selective recompute.
    "pp2_zbv": (2, {"strategy": pp(2, "zbv")}),
    "pp2_dualpipev_full_recompute": (2, {"strategy": pp(2, "dualpipev", activation_checkpointing="full")}),
    "pp2_1f1b_accumulate2": (2, {"strategy": pp(2), "trainer": {"accumulate_grad_batches": 2}}),
    "pp2_1f1b_loss_scaled": (2, {"strategy": pp(2), "loss_scale": 1024.0}),
    "dp2_pp2_zero1_accumulate2": (4, {"strategy": pp(2, zero_stage=1), "trainer": {"accumulate_grad_batches": 2}}),
    "pp4_1f1b": (4, {"strategy": pp(4)}),
    "dp2_pp2_zero3": (4, {"strategy": pp(2, zero_stage=3)}),
    "tp2_pp2_sequence_parallel": (4, {"strategy": pp(2, tensor_parallel_size=2, sequence_parallel=True)}),
    "dp2_tp2_pp2_zero1": (
        8,
        {"strategy": pp(2, tensor_parallel_size=2, zero_stage=1), "checkpoint_every": 8, "test_after_fit": True},
    ),
    "dp2_pp2_zbv_zero1": (4, {"strategy": pp(2, "zbv", zero_stage=1)}),
    "dp2_pp2_dualpipev_zero2_selective_recompute": (
        4,
        {"strategy": pp(2, "dualpipev", zero_stage=2, activation_checkpointing="selective")},
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
        ("moe_ep2_compile", 2, {"expert_parallel_size": 2, "compile": True}),
        ("moe_dp4_ep2", 4, {"expert_parallel_size": 2}),
        ("moe_ep2_zero3", 2, {"expert_parallel_size": 2, "zero_stage": 3}),
        ("moe_dp4_ep2_zero3", 4, {"expert_parallel_size": 2, "zero_stage": 3}),
        ("moe_dp4_ep2_zero0", 4, {"expert_parallel_size": 2, "zero_stage": 0}),
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
    "callbacks": [CommReport(step=5)], "trainer": {"max_steps": 6},
})  # fmt: skip


# Context parallelism: sequences of 256 tokens (2 x cp chunks each), compared with their own single-process run;
# every layout also measures its bytes per axis in step 5.
LONG = {"model": {"config": dict(SMALL_GPT, max_seq_len=256)}, "data": {"seq_len": 256, "global_batch_size": 4}}
CP_LAYOUTS = {
    name: (world, {**LONG, "strategy": strategy, "callbacks": [CommReport(step=5)]})
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
    name: (world, {**LONG_MOE, "strategy": strategy, "callbacks": [CommReport(step=5)]})
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
# same in every layout: `lit3d.models.lora_dropout`), compared with its own single-process run.
LORA = {
    "model": {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}}
}
LORA_LAYOUTS = {
    name: (world, {**LORA, "strategy": strategy})
    for name, world, strategy in [
        ("lora_dp2_zero0", 2, {"zero_stage": 0}),
        ("lora_dp2_zero1", 2, {"zero_stage": 1}),
        ("lora_dp2_zero2", 2, {"zero_stage": 2}),
        ("lora_dp2_zero3", 2, {"zero_stage": 3}),
        ("lora_tp2", 2, {"tensor_parallel_size": 2}),
        ("lora_tp2_sequence_parallel", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
        ("lora_pp2_resumed_from_tp2", 2, pp(2)),
        ("lora_pp2", 2, pp(2)),
        ("lora_pp2_zbv", 2, pp(2, "zbv")),
        ("lora_pp2_interleaved", 2, pp(2, "interleaved_1f1b")),
        ("lora_dp2_pp2_zero1_full_recompute_accumulate2", 4, {"zero_stage": 1, "activation_checkpointing": "full",
                                                               **pp(2)}),
        ("lora_dp2_tp2_zero3", 4, {"tensor_parallel_size": 2, "zero_stage": 3}),
    ]
}  # fmt: skip
# An MoE model with adapters on its attention and on each expert, the experts (and their adapters) split over EP.
LORA_MOE = {
    "model": {
        "config": SMALL_MOE,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q", "v", "gate", "down"]},
    }
}
LORA_LAYOUTS["lora_moe_ep2"] = (2, {**LORA_MOE, "strategy": {"expert_parallel_size": 2}})
# Context parallelism: the adapters on sequences of 256 tokens, split over 2 ranks.
LORA_LONG = {**LONG, "model": {**LONG["model"], **LORA["model"]}}
LORA_LAYOUTS["lora_cp2"] = (2, {**LORA_LONG, "strategy": {"context_parallel_size": 2}})
LORA_LAYOUTS["lora_dp2_zero3_offload"] = (2, {**LORA, "strategy": {"zero_stage": 3, "offload": True},
                                             "callbacks": [OffloadProbe()]})  # fmt: skip
LORA_LAYOUTS["lora_dp2_pp2_zero1_full_recompute_accumulate2"][1]["trainer"] = {"accumulate_grad_batches": 2}
LORA_LAYOUTS["lora_tp2"][1]["checkpoint_every"] = 4
LORA_LAYOUTS["lora_pp2_resumed_from_tp2"][1]["ckpt_path"] = "job:lora_tp2/ckpts/step=4.ckpt"


# Chat data (answers of 1 to 200 tokens, prompts masked) packed into 256-token rows, and short documents packed with
# document masking: each compared with its own single-process run.
CHAT_GPT = dict(SMALL_GPT, vocab_size=320, max_seq_len=256)
CHAT = {"data_class": "chat", "model": {"config": CHAT_GPT}, "trainer": {"max_steps": 6, "val_check_interval": 3}}
DOCUMENTS = {**LONG, "data": {**LONG["data"], "document_masking": True}}
PACKED_LAYOUTS = {
    "chat_dp2": (2, {**CHAT, "strategy": {}}),
    "chat_pp2_4_microbatches": (2, {**CHAT, "strategy": pp(2, num_microbatches=4)}),
    "chat_cp2": (2, {**CHAT, "strategy": {"context_parallel_size": 2}}),
    "chat_tp2_sequence_parallel": (2, {**CHAT, "strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}}),
    "documents_cp2": (2, {**DOCUMENTS, "strategy": {"context_parallel_size": 2}}),
    "documents_pp2": (2, {**DOCUMENTS, "strategy": pp(2, num_microbatches=2)}),
}


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory) -> dict[str, dict]:
    """The ``data`` arguments of the chat and the document-masking runs."""
    import json

    from helpers import chat_file, chat_tokenizer

    folder = tmp_path_factory.mktemp("packed")
    chat = {"data_path": str(chat_file(folder / "chat.jsonl", 120, max_words=200)), "val_fraction": 0.2,
            "tokenizer": str(chat_tokenizer(folder / "tokenizer")), "seq_len": 256, "global_batch_size": 8}  # fmt: skip
    rng = __import__("random").Random(1)
    lines = [json.dumps({"text": " ".join(rng.choices(["ab", "cde", "f", "gh"], k=rng.randint(2, 40)))})
             for _ in range(400)]  # fmt: skip
    (folder / "short.jsonl").write_text("\n".join(lines))
    return {"chat": chat, "documents": {"data_path": str(folder / "short.jsonl")}}


def with_data(job: dict, packed: dict[str, dict]) -> dict:
    """``job`` with the files of `packed_data` if it trains on chat data or on packed short documents."""
    if job.get("data_class") == "chat":
        return merge(job, {"data": packed["chat"]})
    if job.get("data", {}).get("document_masking"):
        return merge(job, {"data": packed["documents"]})
    return job


@pytest.fixture(scope="session")
def reference_chat_run(base_job, packed_data, tmp_path_factory) -> dict:
    """The single-process run on chat data, which its layouts are compared with."""
    return reference(base_job, with_data(CHAT, packed_data), tmp_path_factory.mktemp("reference_chat"))


@pytest.fixture(scope="session")
def reference_documents_run(base_job, packed_data, tmp_path_factory) -> dict:
    """The single-process run on short documents packed with document masking."""
    return reference(base_job, with_data(DOCUMENTS, packed_data), tmp_path_factory.mktemp("reference_documents"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    import random

    words = random.Random(0).choices(
        ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "def", "("], k=6 * 600
    )
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(" ".join(words[i * 600 : (i + 1) * 600]))
    return folder


@pytest.fixture(scope="session")
def base_job(corpus) -> dict:
    return dict(
        model=dict(config=SMALL_GPT, learning_rate=1e-2, warmup_steps=2),
        data=dict(data_path=str(corpus), seq_len=16, global_batch_size=8, val_fraction=0.1),
        trainer=dict(max_steps=8, gradient_clip_val=0.5, limit_val_batches=2, val_check_interval=4),
    )


def reference(base_job: dict, overrides: dict, folder: Path) -> dict:
    """The single-process run of ``base_job`` with ``overrides``, which layouts of the same model are compared with."""
    from spawned import run_job

    return run_job(merge(base_job, overrides), folder)


@pytest.fixture(scope="session")
def reference_run(base_job, tmp_path_factory) -> dict:
    """The single-process run every layout is compared with."""
    return reference(base_job, {"test_after_fit": True}, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def reference_bf16_run(base_job, tmp_path_factory) -> dict:
    """The single-process bf16-mixed run the bf16-mixed layouts are compared with."""
    trainer = {"precision": "bf16-mixed", "max_steps": 12, "val_check_interval": 6}
    return reference(base_job, {"trainer": trainer}, tmp_path_factory.mktemp("reference_bf16"))


@pytest.fixture(scope="session")
def reference_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model, which the MoE layouts are compared with."""
    return reference(base_job, {"model": {"config": SMALL_MOE}}, tmp_path_factory.mktemp("reference_moe"))


@pytest.fixture(scope="session")
def reference_long_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of 256-token sequences, which the context-parallel layouts are compared with."""
    return reference(base_job, LONG, tmp_path_factory.mktemp("reference_long"))


@pytest.fixture(scope="session")
def reference_long_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model on 256-token sequences."""
    return reference(base_job, LONG_MOE, tmp_path_factory.mktemp("reference_long_moe"))


@pytest.fixture(scope="session")
def reference_lora_run(base_job, tmp_path_factory) -> dict:
    """The single-process run with LoRA adapters, which the LoRA layouts are compared with."""
    return reference(base_job, LORA, tmp_path_factory.mktemp("reference_lora"))


@pytest.fixture(scope="session")
def reference_lora_long_run(base_job, tmp_path_factory) -> dict:
    """The single-process run with adapters on 256-token sequences, which context parallelism is compared with."""
    return reference(base_job, LORA_LONG, tmp_path_factory.mktemp("reference_lora_long"))


@pytest.fixture(scope="session")
def reference_lora_moe_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the MoE model with adapters on its attention."""
    return reference(base_job, LORA_MOE, tmp_path_factory.mktemp("reference_lora_moe"))


@pytest.fixture(scope="session")
def family_references(base_job, tmp_path_factory) -> dict[str, dict]:
    """The single-process run of each family's tiny model (`FAMILY_CONFIGS`), which its layouts are compared with."""
    from family_layouts import FAMILY_CONFIGS

    folder = tmp_path_factory.mktemp("reference_families")
    return {
        name: reference(base_job, {"model": {"config": config}}, folder / name)
        for name, config in FAMILY_CONFIGS.items()
    }


@pytest.fixture(scope="session")
def float8_references(base_job, layout_runs, tmp_path_factory) -> dict[str, dict]:
    """On one spawned rank (FP8 is a `Parallel3DStrategy` setting, whose process group must not outlive the run in
    this process): the single-process FP8 runs (``tensorwise``, ``rowwise``) the FP8 layouts are compared with, and
    (``resumed_in_bf16``) the TP2 FP8 run's checkpoint of step `FP8_SAVED` resumed in bf16."""
    from float8_layouts import FP8_JOB, FP8_SAVED, ROWWISE, ROWWISE_HERE, TENSORWISE
    from spawned import run_jobs

    saved = layout_runs["fp8_tp2_sequence_parallel"]["job_dir"] + f"/ckpts/step={FP8_SAVED}.ckpt"
    rowwise = {**FP8_JOB, "strategy": ROWWISE, "expect_error": not ROWWISE_HERE}
    jobs = {"tensorwise": {**FP8_JOB, "strategy": TENSORWISE}, "rowwise": rowwise,
            "resumed_in_bf16": {**FP8_JOB, "strategy": {}, "ckpt_path": saved}}  # fmt: skip
    jobs = {name: merge(base_job, job) for name, job in jobs.items()}
    return run_jobs(1, jobs, tmp_path_factory.mktemp("reference_float8"))


@pytest.fixture(scope="session")
def reference_uneven_run(base_job, tmp_path_factory) -> dict:
    """The single-process run of the 6-block model the uneven pipeline stages are compared with."""
    from uneven_layouts import UNEVEN_GPT

    return reference(base_job, {"model": {"config": UNEVEN_GPT}}, tmp_path_factory.mktemp("reference_uneven"))


@pytest.fixture(scope="session")
def cpu_profile(tmp_path_factory) -> str:
    """A profile as `lit3d calibrate` writes it (the planner's CPU core, two processes), for runs that price their
    step on it (``plan_profile``: ``"CPU_PROFILE"`` in a layout's strategy)."""
    import json
    from dataclasses import asdict

    from lit3d.planner.hardware import cpu_share

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    path.write_text(json.dumps({"gpu": asdict(cpu_share(2, cores=2, memory_gb=8.0)), "collective_latency_us": 50.0}))
    return str(path)


def with_profile(job: dict, profile: str) -> dict:
    strategy = job.get("strategy", {})
    if strategy.get("plan_profile") != "CPU_PROFILE":
        return job
    return {**job, "strategy": {**strategy, "plan_profile": profile}}


@pytest.fixture(scope="session")
def layout_runs(base_job, packed_data, cpu_profile, tmp_path_factory) -> dict[str, dict]:
    """Every layout of `LAYOUTS`, `MOE_LAYOUTS`, `CP_LAYOUTS`, `LORA_LAYOUTS`, `PACKED_LAYOUTS`, `FAMILY_LAYOUTS`,
    `FLOAT8_LAYOUTS`, `UNEVEN_LAYOUTS`, `SHARE_LAYOUTS` and `HSDP_LAYOUTS`, one spawn per world size."""
    from family_layouts import FAMILY_LAYOUTS
    from float8_layouts import FLOAT8_LAYOUTS
    from hsdp_layouts import HSDP_LAYOUTS
    from spawned import run_jobs
    from uneven_layouts import SHARE_LAYOUTS, UNEVEN_LAYOUTS

    layouts = {**LAYOUTS, **MOE_LAYOUTS, **CP_LAYOUTS, **LORA_LAYOUTS, **PACKED_LAYOUTS, **FAMILY_LAYOUTS,
               **FLOAT8_LAYOUTS, **UNEVEN_LAYOUTS, **SHARE_LAYOUTS, **HSDP_LAYOUTS}  # fmt: skip
    results = {}
    for world in sorted({w for w, _ in layouts.values()}):
        jobs = {
            name: merge(base_job, with_profile(with_data(job, packed_data), cpu_profile))
            for name, (w, job) in layouts.items()
            if w == world
        }
        results.update(run_jobs(world, jobs, tmp_path_factory.mktemp(f"world{world}")))
    return results


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
    LAYOUTS[_name][1]["callbacks"] = [CommReport(step=5)]
for _name in ["dp2_zero0", "dp2_zero3", "tp2", "pp2_1f1b", "dp2_tp2_pp2_zero1"]:
    LAYOUTS[_name][1]["validate_after_fit"] = True


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def dp2_then_resumed_on_one_process(job: dict, out: Path) -> dict[str, dict]:
    """``job`` at DP2 checkpointed after step 4 (``"dp2"``), and resumed from that checkpoint on one process
    (``"resume_single"``): for runs that must continue exactly on another data-parallel size."""
    from spawned import run_jobs

    step4 = str(out / "dp2" / "ckpts" / "step=4.ckpt")
    results = run_jobs(2, {"dp2": merge(job, {"strategy": {}, "checkpoint_every": 4})}, out)
    results.update(run_jobs(1, {"resume_single": merge(job, {"strategy": {}, "ckpt_path": step4})}, out))
    return results
