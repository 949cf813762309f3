"""Muon's layouts (`lit3d.models.muon`), each against its own single process: ZeRO-1 (each matrix's update gathered
from the replicas' slices), ZeRO-3 (each matrix gathered from its FSDP2 shards for its step), TP2 with sequence
parallelism (gathered from its TP shards), DP2 x TP2 at ZeRO-3 (gathered over both), a V-shaped pipeline (each stage's
matrices its own) and the MoE model's experts over EP2, each orthogonalised on the rank that holds it (at DP4 x EP2
with ZeRO-1, gathered from the slices of the 2 ranks that hold it). Those in
`MUON_COMMS` measure the bytes of a step against the planner's. `MUON_RESUMED`: the momentum saved at step `HALF` in
one layout resumes in another (DP2 x TP2 x ZeRO-3's shards into DP2 x PP2's stages, TP2's into ZeRO-3's). The
Newton-Schulz iteration runs in fp32 here (``muon_ns_dtype``): in bf16 a last-bit difference of a gradient summed in
another order can round one way on one layout and the other way on another."""

from layouts import COMMS_STEP, DEEP_GPT, HALF, SMALL_MOE, saved_at_half

from lit3d.callbacks import CommReport

MUON = {"model": {"optimizer": "muon", "muon_ns_dtype": "float32"}}
MUON_DEEP = {"model": {**MUON["model"], "config": DEEP_GPT}}  # four stages in a V
MUON_MOE = {"model": {"config": SMALL_MOE, "optimizer": "muon", "muon_ns_dtype": "float32"}}
# QK-clip (MuonClip) at a threshold the small model's heads pass now and then (3, 1 and 1 of its 8 heads clipped in
# the 3 steps of one process): each rank's heads' logits, their max over the replicas, the factors on its slices
CLIP = 0.045
MUON_CLIP = {"model": {**MUON["model"], "muon_qk_clip": CLIP}, "whole_param_sum": True}
MUON_LAYOUTS = {
    "muon_dp2_zero1": (2, {**MUON, "strategy": {"zero_stage": 1}}),
    "muon_dp2_zero3": (2, {**MUON, "strategy": {"zero_stage": 3}}),
    "muon_tp2_sequence_parallel": (2, {**MUON, "strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}}),
    "muon_dp2_tp2_zero3": (4, {**MUON, "strategy": {"tensor_parallel_size": 2, "zero_stage": 3}}),
    "muon_pp2_zbv": (2, {**MUON_DEEP, "strategy": {"pipeline_parallel_size": 2, "pipeline_schedule": "zbv"}}),
    "muon_moe_ep2": (2, {**MUON_MOE, "strategy": {"expert_parallel_size": 2, "zero_stage": 0}}),
    # each expert sliced by ZeRO-1 over the 2 ranks that hold it, gathered whole there for its step
    "muon_moe_dp4_ep2_zero1": (4, {**MUON_MOE, "strategy": {"expert_parallel_size": 2, "zero_stage": 1}}),
    "muon_clip_dp2_zero1": (2, {**MUON_CLIP, "strategy": {"zero_stage": 1}}),
    # (ZeRO-2's blocks stay unsharded from forward to backward: the factors are laid out at the step, on the shards)
    "muon_clip_dp2_zero2": (2, {**MUON_CLIP, "strategy": {"zero_stage": 2}}),
    "muon_clip_tp2_sequence_parallel": (
        2,
        {**MUON_CLIP, "strategy": {"tensor_parallel_size": 2, "sequence_parallel": True}},
    ),
    "muon_clip_pp2_1f1b": (2, {**MUON_CLIP, "strategy": {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}}),
}
# bytes measured against the planner's
MUON_COMMS = (
    "muon_dp2_zero1",
    "muon_dp2_zero3",
    "muon_tp2_sequence_parallel",
    "muon_moe_ep2",
    "muon_moe_dp4_ep2_zero1",
)
for _name in MUON_COMMS:
    MUON_LAYOUTS[_name][1]["callbacks"] = [CommReport(step=COMMS_STEP)]

# the momentum saved in one layout, resumed in another (compared with the single process from step HALF on)
MUON_LAYOUTS["muon_dp2_tp2_zero3"][1]["checkpoint_at"] = HALF
MUON_LAYOUTS["muon_tp2_sequence_parallel"][1]["checkpoint_at"] = HALF
PP2 = {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
MUON_RESUMED = {
    "muon_dp2_pp2_resumed_from_dp2_tp2_zero3": (
        4,
        {**MUON, "strategy": PP2, "ckpt_path": saved_at_half("muon_dp2_tp2_zero3")},
    ),
    "muon_dp2_zero3_resumed_from_tp2_sequence_parallel": (
        2,
        {**MUON, "strategy": {"zero_stage": 3}, "ckpt_path": saved_at_half("muon_tp2_sequence_parallel")},
    ),
}
