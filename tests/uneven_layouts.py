"""Pipeline stages of uneven depth (``pipeline_stage_layers``: more blocks on faster or larger GPUs), each compared with
the single-process run of the same 6-block model: PP2 with 1+5 and 5+1, interleaved PP2 with 2+1+2+1 (four stages,
two per rank), and DP2 x PP2 at ZeRO-1 and ZeRO-3; and stages that hold the embedding or the head in place of a
block, as Llama 3 405B's first and last did: PP2 with 0+6, and interleaved PP2 with four chunks each, eight stages
for six blocks (the ends alone, cut so by default)."""

from layouts import HALF, saved_at_half

UNEVEN_GPT = dict(n_layer=6, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=257, max_seq_len=32)


def _layouts() -> dict[str, tuple[int, dict]]:
    pp2 = {"pipeline_parallel_size": 2}
    layouts = {
        "pp2_layers_1_5": (2, {**pp2, "pipeline_stage_layers": [1, 5]}),
        "pp2_interleaved_layers_2_1_2_1": (2, {**pp2, "pipeline_schedule": "interleaved_1f1b",
                                               "pipeline_stage_layers": [2, 1, 2, 1]}),
        "dp2_pp2_zero1_layers_4_2": (4, {**pp2, "zero_stage": 1, "pipeline_stage_layers": [4, 2]}),
        "dp2_pp2_zero3_layers_2_4": (4, {**pp2, "zero_stage": 3, "pipeline_stage_layers": [2, 4]}),
        "pp2_layers_0_6": (2, {**pp2, "pipeline_stage_layers": [0, 6]}),
        "pp2_interleaved_v4_ends_alone": (2, {**pp2, "pipeline_schedule": "interleaved_1f1b",
                                              "virtual_pipeline_size": 4}),
    }  # fmt: skip
    return {name: (world, {"model": {"config": UNEVEN_GPT}, "strategy": strategy})
            for name, (world, strategy) in layouts.items()}  # fmt: skip


UNEVEN_LAYOUTS = _layouts()


# Uneven data parallelism (``data_parallel_shares``: samples of each global batch of 8 per replica), compared with the
# plain single-process run; one saved at step `HALF` resumes with even replicas.
SHARE_LAYOUTS = {
    name: (world, {"strategy": strategy})
    for name, world, strategy in [
        ("dp2_shares_6_2_zero1", 2, {"zero_stage": 1, "data_parallel_shares": [6, 2]}),
        ("dp2_shares_2_6_zero3", 2, {"zero_stage": 3, "data_parallel_shares": [2, 6]}),
        ("dp2_even_resumed_from_shares", 2, {"zero_stage": 1}),
        ("dp2_tp2_shares_6_2_zero3", 4, {"tensor_parallel_size": 2, "zero_stage": 3, "data_parallel_shares": [6, 2]}),
    ]
}  # fmt: skip
SHARE_LAYOUTS["dp2_shares_6_2_zero1"][1]["checkpoint_at"] = HALF
SHARE_LAYOUTS["dp2_even_resumed_from_shares"][1]["ckpt_path"] = saved_at_half("dp2_shares_6_2_zero1")
