"""FP8 training (``float8``) on each axis (ZeRO-1 under recompute, ZeRO-3 gathering in FP8, TP with SP, both scale
recipes, PP, CP), each compared with the single-process FP8 run of the same model: widths
in multiples of 16 on every TP rank (FP8 matmuls need them), bf16-mixed, `FP8_STEPS` steps at a learning rate that
does not spike (an FP8 run's rounding would move a spike's step, not the curve), saved at `FP8_SAVED`."""

import lightning as L

FP8_GPT = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=257, max_seq_len=64)
FP8_STEPS, FP8_SAVED = 4, 2
FP8_JOB = {
    "model": {"config": FP8_GPT, "learning_rate": 3e-3, "warmup_steps": 2},
    "data": {"seq_len": 32},
    "trainer": {"max_steps": FP8_STEPS, "limit_val_batches": 0, "precision": "bf16-mixed"},
}
TENSORWISE, ROWWISE = {"float8": "tensorwise"}, {"float8": "rowwise"}  # (on CPU: torchao's emulated matmuls)


class Float8Probe(L.Callback):
    """Counts the linears that run in FP8 (torchao's ``Float8Linear``) on this rank."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_start(self, trainer, pl_module) -> None:
        from torchao.float8.float8_linear import Float8Linear

        self.count = sum(isinstance(m, Float8Linear) for m in pl_module.modules())

    def results(self) -> dict:
        return {"float8_linears": self.count}


def _layouts() -> dict[str, tuple[int, dict]]:
    from lit3d.callbacks import CommReport

    tp2_sp = {"tensor_parallel_size": 2, "sequence_parallel": True}
    pp2 = {"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}
    layouts = {
        "fp8_dp2_zero1_recompute": (2, {**TENSORWISE, "zero_stage": 1, "activation_checkpointing": "full"}),
        "fp8_dp2_zero3_all_gather": (2, {**TENSORWISE, "zero_stage": 3, "float8_all_gather": True}),
        "fp8_tp2_sequence_parallel": (2, {**TENSORWISE, **tp2_sp}),
        "fp8_pp2": (2, {**TENSORWISE, **pp2}),
        "fp8_cp2": (2, {**TENSORWISE, "context_parallel_size": 2}),
        "fp8_rowwise_tp2_sequence_parallel": (2, {**ROWWISE, **tp2_sp}),
        "bf16_dp2_zero3": (2, {"zero_stage": 3}),  # the bytes FP8 all-gather halves
    }
    jobs = {name: (world, {**FP8_JOB, "strategy": strategy, "callbacks": [Float8Probe()]})
            for name, (world, strategy) in layouts.items()}  # fmt: skip
    for name in ("fp8_dp2_zero3_all_gather", "bf16_dp2_zero3"):
        jobs[name][1]["callbacks"].append(CommReport(step=FP8_SAVED + 1))  # (after the first steps and the save)
    jobs["fp8_tp2_sequence_parallel"][1]["checkpoint_at"] = FP8_SAVED
    jobs["fp8_dp2_zero3_all_gather"][1]["checkpoint_at"] = FP8_SAVED
    return jobs


FLOAT8_LAYOUTS = _layouts()
