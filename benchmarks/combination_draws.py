"""The draws of `benchmarks/combinations.py`: one combination of the settings (`Draw`), drawn where each setting
means something (`draw`), and the model, data and tolerances it is trained and held to."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

# A Llama-style model of 4 blocks with grouped-query heads whose widths suit FP8 on 2 TP ranks (multiples of 16), and
# its Mixture-of-Experts variant: 4 experts, 2 per token, after one dense block.
MODEL = dict(n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=257, max_seq_len=64)
MOE = dict(n_expert=4, n_expert_per_token=2, d_ff_expert=64, first_dense_layers=1)
LORA = dict(rank=4, alpha=8.0, targets=["q", "k", "v", "o", "gate", "up", "down"])
# DeepSeek-V3's shape (`latent`): multi-head latent attention with low-rank queries (head 16 + 16 wide, values 16,
# widths in multiples of 16 on 2 TP ranks), YaRN in interleaved pairs and one multi-token-prediction depth; with MoE,
# DeepSeekMoE's sigmoid router over 2 groups of experts, a shared expert and the balancing bias.
LATENT = dict(
    n_kv_head=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    rope_interleave=True,
    num_nextn_predict_layers=1,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
)
DEEPSEEK_MOE = dict(
    router="sigmoid", n_group=2, topk_group=1, n_shared_experts=1, d_ff_expert=32, routed_scaling_factor=2.5
)
# gpt-oss's attention (`windowed`): windows of 16 tokens (of 64) in every other block, a sink per head, biases on q, k,
# v and o.
WINDOWED = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2, attention_sinks=True,
                attention_bias=True)  # fmt: skip
LATENT_LORA = dict(LORA, targets=["q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down"])  # (no k or v: the latent)
SEQ_LEN, GLOBAL_BATCH = 64, 16
FP32_TOLERANCE, BF16_TOLERANCE = 1e-5, 1e-2


@dataclass
class Draw:
    """One combination: the strategy's settings (`Parallel3DStrategy`'s arguments that are not their default) and the
    loop, model and data around it."""

    index: int
    world: int
    settings: dict[str, Any]
    precision: str = "32-true"
    accumulate: int = 1
    clip: float | None = None
    moe: bool = False
    latent: bool = False  # DeepSeek-V3's shape (`LATENT`, and `DEEPSEEK_MOE` with ``moe``)
    windowed: bool = False  # gpt-oss's attention (`WINDOWED`): windows and sinks
    muon: bool = False  # Muon for the hidden matrices (its Newton-Schulz iteration in fp32: exact against one process)
    lora: bool = False
    documents: bool = False
    outcome: str = ""  # exact | refused | failed
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def tolerance(self) -> float:
        return FP32_TOLERANCE if self.precision == "32-true" else BF16_TOLERANCE

    def layout(self) -> str:
        s = self.settings
        parts = [f"{axis}{s[key]}" for axis, key in AXES if s.get(key, 1) != 1]
        if s.get("sequence_parallel"):
            parts[[p[:2] for p in parts].index("TP")] += "(SP)"
        if s.get("pipeline_parallel_size", 1) > 1:
            parts.append(s.get("pipeline_schedule", "1f1b"))
            for key, short in (("virtual_pipeline_size", "v"), ("num_microbatches", "m")):
                if s.get(key):
                    parts.append(f"{short}={s[key]}")
            if s.get("pipeline_stage_layers"):
                parts.append(f"stages={s['pipeline_stage_layers']}")
        parts.append(f"ZeRO-{s.get('zero_stage', 1)}" + (" offload" if s.get("offload") else ""))
        if s.get("data_parallel_shard_size"):
            parts.append(f"HSDP shard groups of {s['data_parallel_shard_size']}")
        if s.get("accumulate_unsharded"):
            parts.append("unsharded accumulation")
        if s.get("data_parallel_shares"):
            parts.append(f"shares={s['data_parallel_shares']}")
        if s.get("activation_checkpointing"):
            parts.append(f"{s['activation_checkpointing']} recompute")
        if s.get("compile"):
            parts.append(f"compile={s['compile']}")
        if s.get("mixed_precision_reduce", "float32") != "float32":
            parts.append(f"reduce {s['mixed_precision_reduce']}")
        if s.get("float8"):
            parts.append(f"FP8 {s['float8']}" + (" all-gather" if s.get("float8_all_gather") else ""))
        if s.get("sync_every", 1) > 1:
            parts.append(f"DiLoCo H={s['sync_every']}")
        return " ".join(parts)

    def loop(self) -> str:
        parts = [self.precision]
        parts += [f"accumulate {self.accumulate}"] if self.accumulate > 1 else []
        parts += [f"clip {self.clip}"] if self.clip else []
        return ", ".join(parts)

    def model_and_data(self) -> str:
        model = "MoE" if self.moe else "dense"
        if self.latent:
            model = "MLA + MTP, " + ("DeepSeekMoE" if self.moe else "dense")
        parts = (
            [model] + ["windows + sinks"] * self.windowed + ["LoRA"] * self.lora + ["document masks"] * self.documents
        )
        if self.muon:
            parts.append("Muon")
        return ", ".join(parts)

    def model(self, base: dict = MODEL) -> tuple[dict, dict]:
        """The `GPTConfig` arguments of this draw's model (from ``base``) and its LoRA arguments."""
        config = dict(base, **(MOE if self.moe else {}))
        if self.latent:
            config.update(LATENT, **(DEEPSEEK_MOE if self.moe else {}))
        if self.windowed:
            config.update(WINDOWED)
        return config, (LATENT_LORA if self.latent else LORA)


AXES = (("DP", "data_parallel_size"), ("TP", "tensor_parallel_size"), ("PP", "pipeline_parallel_size"),
        ("CP", "context_parallel_size"), ("EP", "expert_parallel_size"))  # fmt: skip


def draw(rng: random.Random, index: int, max_ranks: int = 8) -> Draw:
    """One combination: the world size, its split over the axes, and every other setting drawn where it means
    something (a schedule only with a pipeline, FP8 and the reduce dtype only under bf16, ...)."""
    from lit3d.parallel.schedules import SCHEDULES
    from lit3d.parallel.settings import Parallelism

    world = rng.choice([w for w in (2, 2, 4, 4, 4, 8, 8) if w <= max_ranks])
    sizes = dict.fromkeys(("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
                           "context_parallel_size"), 1)  # fmt: skip
    for _ in range(world.bit_length() - 1):  # each factor of 2 to an axis
        axis = rng.choices(list(sizes), weights=(3, 2, 2, 1.5))[0]
        sizes[axis] *= 2
    d = Draw(index, world, dict(sizes))
    s = d.settings
    dp, tp, pp = sizes["data_parallel_size"], sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"]
    d.moe = rng.random() < 0.3
    if d.moe:
        s["expert_parallel_size"] = rng.choice([e for e in (1, 2, 4) if dp % e == 0])
    s["zero_stage"] = rng.choice([0, 1, 2, 3])
    s["offload"] = s["zero_stage"] == 3 and rng.random() < 0.25
    s["sequence_parallel"] = tp > 1 and rng.random() < 0.5
    if pp > 1:
        s["pipeline_schedule"] = rng.choice(list(SCHEDULES))
        if SCHEDULES[s["pipeline_schedule"]].chunks is None:
            s["virtual_pipeline_size"] = rng.choice([None, 2])
        s["num_microbatches"] = rng.choice([None, None, pp, 2 * pp])
    s["activation_checkpointing"] = rng.choice([False, "full", "selective"])
    s["compile"] = rng.choice([False] * 7 + ["aot_eager"])
    d.precision = rng.choice(["32-true"] * 3 + ["bf16-mixed"])
    if d.precision == "bf16-mixed":
        s["mixed_precision_reduce"] = rng.choice(["float32", "bfloat16"])
        s["float8"] = rng.choice([None, None, "tensorwise", "rowwise"])
        s["float8_all_gather"] = s["float8"] == "tensorwise" and s["zero_stage"] >= 2 and rng.random() < 0.5
    s["sync_every"] = rng.choice([1, 1, 1, 1, 2])
    if "accumulate_unsharded" in {f.name for f in fields(Parallelism)}:
        s["accumulate_unsharded"] = s["zero_stage"] >= 2 and rng.random() < 0.5
    d.accumulate = rng.choice([1, 2])
    d.clip = rng.choice([None, 0.5])
    d.lora = rng.random() < 0.25
    d.documents = rng.random() < 0.4
    d.latent = rng.random() < 0.3
    if pp > 1 and rng.random() < 0.25:
        s["pipeline_stage_layers"] = _uneven_stages(rng, pp * _chunks(s))
    if dp > 1 and rng.random() < 0.2:
        s["data_parallel_shares"] = _uneven_shares(rng, dp, d.accumulate * _microbatches(s, dp, d.accumulate))
    d.windowed = (
        not d.latent and rng.random() < 0.3
    )  # (drawn last: the earlier draws' other settings stay as they were)
    # NOTE: Muon is drawn from a generator of its own, seeded by the sweep's state, which it leaves as it was: a seed's
    # draws stay those the docs quote, now some of them with Muon.
    d.muon = random.Random(hash(rng.getstate()[1])).random() < 0.25  # (its ints: hash(None) varies by process)
    default = {f.name: f.default for f in fields(Parallelism)}
    d.settings = {k: v for k, v in s.items() if not (v == default[k] and type(v) is type(default[k]))}
    return d


def _chunks(settings: dict) -> int:
    from lit3d.parallel.schedules import chunks_per_rank

    try:
        return chunks_per_rank(settings["pipeline_schedule"], settings.get("virtual_pipeline_size"))
    except ValueError:
        return 1


def _microbatches(settings: dict, dp: int, accumulate: int) -> int:
    from lit3d.parallel.layout import pipeline_microbatches

    pp = settings.get("pipeline_parallel_size", 1)
    if pp == 1:
        return 1
    try:
        return pipeline_microbatches(settings.get("num_microbatches"), GLOBAL_BATCH, dp, accumulate, pp,
                                     _chunks(settings), settings["pipeline_schedule"])  # fmt: skip
    except ValueError:
        return 1


def _uneven_stages(rng: random.Random, stages: int) -> list[int] | None:
    """An uneven split of the model's blocks over ``stages`` (None if only the even one exists)."""
    n = MODEL["n_layer"]
    if stages >= n:
        return None
    cuts = sorted(rng.sample(range(1, n), stages - 1))
    split = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    return split if len(set(split)) > 1 else None


def _uneven_shares(rng: random.Random, replicas: int, unit: int) -> list[int] | None:
    """Each replica's samples of the global batch, unevenly, in whole ``unit``s (None if they cannot be uneven)."""
    units = GLOBAL_BATCH // unit
    if units <= replicas:
        return None
    cuts = sorted(rng.sample(range(1, units), replicas - 1))
    shares = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, units])]
    return shares if len(set(shares)) > 1 else None


# Muon in each layout its issue lists (`--muon-layouts`): the data-parallel ZeRO stages and HSDP, TP with sequence
# parallelism, a pipeline on two schedules, the MoE model over EP, CP, 8 ranks in 3D, and accumulation with clipping.
MUON_LAYOUTS = (
    (2, {"data_parallel_size": 2, "zero_stage": 0}, {}),
    (2, {"data_parallel_size": 2, "zero_stage": 1}, {}),
    (2, {"data_parallel_size": 2, "zero_stage": 2}, {}),
    (2, {"data_parallel_size": 2, "zero_stage": 3}, {}),
    (4, {"data_parallel_size": 4, "zero_stage": 3, "data_parallel_shard_size": 2}, {}),
    (4, {"data_parallel_size": 4, "zero_stage": 1}, {"accumulate": 2, "clip": 0.5}),
    (2, {"tensor_parallel_size": 2, "sequence_parallel": True}, {}),
    (2, {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}, {}),
    (2, {"pipeline_parallel_size": 2, "pipeline_schedule": "zbv"}, {}),
    (2, {"data_parallel_size": 2, "expert_parallel_size": 2}, {"moe": True}),
    (2, {"context_parallel_size": 2}, {}),
    (8, {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1}, {}),
)


def muon_layouts() -> list[Draw]:
    """`MUON_LAYOUTS` as draws, each with Muon."""
    return [Draw(i + 1, world, settings, muon=True, **loop) for i, (world, settings, loop) in enumerate(MUON_LAYOUTS)]
