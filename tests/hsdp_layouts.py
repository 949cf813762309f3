"""HSDP (``data_parallel_shard_size``): ZeRO inside groups of consecutive data-parallel ranks, the groups replicas of
one another. DP4 in two groups of 2 at ZeRO-1, 2 (accumulating 2 micro-steps) and 3; DP4 x TP2 in groups of 2 at
ZeRO-1, DP4 x PP2 at ZeRO-3 and DP4 x CP2 at ZeRO-1 (a group: 2 x 2 ranks); each compared with the plain
single-process run, with the bytes of one step measured per axis. The DP4 ZeRO-3 run saves at step `HALF` and DP2 x TP2
(ZeRO-1, no groups) resumes it."""

from layouts import ACCUMULATE2, COMMS_STEP, HALF, saved_at_half

from lit3d.callbacks import CommReport


def _layouts() -> dict[str, tuple[int, dict]]:
    groups = {"data_parallel_shard_size": 2}
    layouts = {
        "dp4_shard2_zero1": (4, {**groups, "zero_stage": 1}),
        "dp4_shard2_zero2_accumulate2": (4, {**groups, "zero_stage": 2}),
        "dp4_shard2_zero3": (4, {**groups, "zero_stage": 3}),
        "dp2_tp2_zero1_resumed_from_dp4_shard2_zero3": (4, {"tensor_parallel_size": 2, "zero_stage": 1}),
        "dp4_tp2_shard2_zero1": (8, {**groups, "tensor_parallel_size": 2, "zero_stage": 1}),
        "dp4_pp2_shard2_zero3": (8, {**groups, "pipeline_parallel_size": 2, "zero_stage": 3}),
    }
    jobs = {name: (world, {"strategy": strategy, "callbacks": [CommReport(step=COMMS_STEP)]})
            for name, (world, strategy) in layouts.items()}  # fmt: skip
    jobs["dp4_shard2_zero2_accumulate2"][1]["trainer"] = ACCUMULATE2
    jobs["dp4_shard2_zero3"][1]["checkpoint_at"] = HALF
    jobs["dp2_tp2_zero1_resumed_from_dp4_shard2_zero3"][1]["ckpt_path"] = saved_at_half("dp4_shard2_zero3")
    return jobs


HSDP_LAYOUTS = _layouts()
