"""Checkpoints: sharded saves that any layout resumes exactly, atomic writes, clear errors, HuggingFace in and out."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from layouts import SMALL_GPT, merge, pp
from lightning.pytorch.callbacks import Callback
from spawned import run_jobs

STEPS, SAVED = 4, 2  # the uninterrupted run, and the step its checkpoints are resumed from


@pytest.fixture(scope="module")
def saved(base_job, tmp_path_factory) -> dict:
    """A DP2 x PP2 (ZeRO-1) run that checkpoints at step `SAVED`, then resumes from step `SAVED` in other
    layouts."""
    base = merge(base_job, {"trainer": {"limit_val_batches": 0, "max_steps": STEPS}})
    out = tmp_path_factory.mktemp("checkpoints")
    saved_at = str(out / "dp2_pp2" / "ckpts" / f"step={SAVED}.ckpt")
    world4 = {
        "dp2_pp2": merge(base, {"strategy": pp(2), "checkpoint_at": SAVED}),
        "resume_dp2_pp2": merge(base, {"strategy": pp(2), "ckpt_path": saved_at}),
        "resume_tp2_pp2": merge(base, {"strategy": pp(2, tensor_parallel_size=2), "ckpt_path": saved_at}),
        "resume_dp4_zero3": merge(base, {"strategy": {"zero_stage": 3}, "ckpt_path": saved_at}),
    }
    results = run_jobs(4, world4, out)
    single = {"resume_single_process": merge(base, {"strategy": {}, "ckpt_path": saved_at})}
    results.update(run_jobs(1, single, out))
    return {"results": results, "saved": Path(saved_at), "base": base, "out": out}


def test_a_checkpoint_is_a_folder_of_shards_with_layout_free_names(saved):
    import torch.distributed.checkpoint as dcp

    folder = saved["saved"]
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # every rank
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert "state_dict.model.blocks.1.attn.q_proj.weight" in keys  # (stage 1's) the name a single process would use
    assert "optimizer_states.0.state.model.blocks.0.mlp.up_proj.weight.exp_avg" in keys
    assert keys["state_dict.model.embed.weight"].size == torch.Size([320, 32])  # global shapes, not shards
    assert not folder.with_name(folder.name + ".partial").exists()


def test_resuming_on_the_same_layout_is_bit_identical(saved):
    results = saved["results"]
    assert results["resume_dp2_pp2"]["losses"] == results["dp2_pp2"]["losses"][SAVED:]


@pytest.mark.parametrize("layout", ["resume_tp2_pp2", "resume_dp4_zero3", "resume_single_process"])
def test_resuming_on_another_layout_continues_the_loss_curve(saved, layout):
    uninterrupted = saved["results"]["dp2_pp2"]["losses"]
    resumed = saved["results"][layout]["losses"]
    assert len(uninterrupted) == STEPS and len(resumed) == STEPS - SAVED
    # data position, optimizer, LR schedule and step counters all carried over (DP 2 -> 1, 2 or 4)
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[SAVED:])) <= 1e-5


class SaveTwiceDyingOnTheSecond(Callback):
    """Saves ``path`` after step `SAVED`, then again after the next, and the process dies while writing the second."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == SAVED + 1:
            import lit3d.checkpoint.folder

            original = lit3d.checkpoint.folder.dcp.save

            def save_then_die(*a, **k):
                original(*a, **k)  # this rank's shards are written ...
                os._exit(1)  # ... and the process is gone before the checkpoint is complete

            lit3d.checkpoint.folder.dcp.save = save_then_die
        if trainer.global_step in (SAVED, SAVED + 1):
            trainer.save_checkpoint(self.path)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(saved, tmp_path):
    import torch.multiprocessing as mp

    latest = tmp_path / "latest.ckpt"
    job = merge(saved["base"], {"strategy": {"zero_stage": 1}, "callbacks": [SaveTwiceDyingOnTheSecond(str(latest))]})
    with pytest.raises(mp.ProcessExitedException):
        run_jobs(2, {"crash": job}, tmp_path / "crash")
    assert (tmp_path / "latest.ckpt.partial").is_dir()  # the interrupted save, never published
    # The checkpoint from step SAVED is intact: a new run resumes from it onto the uninterrupted curve.
    resumed = run_jobs(
        1, {"resume": merge(saved["base"], {"strategy": {}, "ckpt_path": str(latest)})}, tmp_path / "resumed"
    )["resume"]["losses"]
    uninterrupted = saved["results"]["dp2_pp2"]["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted[SAVED:])) <= 1e-5


def test_bad_checkpoints_are_refused_on_every_rank_with_the_file_named(saved, tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    shutil.copytree(saved["saved"], truncated)
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    corrupted = tmp_path / "corrupted.ckpt"  # same size, garbage inside: DCP's own read fails, on every rank
    shutil.copytree(saved["saved"], corrupted)
    shard = corrupted / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    wide = dict(SMALL_GPT, d_model=48, n_head=4)
    jobs = {
        "missing": merge(
            saved["base"], {"strategy": {}, "ckpt_path": str(tmp_path / "nope.ckpt"), "expect_error": True}
        ),
        "truncated": merge(saved["base"], {"strategy": {}, "ckpt_path": str(truncated), "expect_error": True}),
        "corrupted": merge(saved["base"], {"strategy": {}, "ckpt_path": str(corrupted), "expect_error": True}),
        "other_shape": merge(
            saved["base"],
            {"strategy": {}, "ckpt_path": str(saved["saved"]), "expect_error": True, "model": {"config": wide}},
        ),
        "other_optimizer": merge(
            saved["base"],
            {"strategy": {}, "ckpt_path": str(saved["saved"]), "expect_error": True, "model": {"optimizer": "muon"}},
        ),
    }
    results = run_jobs(2, jobs, tmp_path / "runs", deadline=240)  # raises if any rank hangs
    expected = {
        "missing": f"checkpoint '{tmp_path / 'nope.ckpt'}' does not exist",
        "truncated": f"checkpoint '{truncated}' is truncated: '__1_0.distcp' has",
        "corrupted": f"reading checkpoint '{corrupted}' failed (a truncated or corrupted file?)",
        "other_shape": "state_dict.model.blocks.0.attn.k_proj.weight: checkpoint (16, 32) vs model (24, 48)",
        "other_optimizer": f"checkpoint '{saved['saved']}' was trained with optimizer='adamw', this run with 'muon'",
    }
    for name, message in expected.items():
        errors = [rank["error"] for rank in results[name]["ranks"]]
        assert all(error and message in error for error in errors), (name, errors)
    # `lit3d fit --ckpt_path FOLDER` and the strategy's launcher check the optimizer before any rank starts
    from lit3d import GPT, GPTConfig
    from lit3d.checkpoint.folder import check_ckpt_path

    with pytest.raises(ValueError, match=re.escape(expected["other_optimizer"])):
        check_ckpt_path(saved["saved"], GPT(GPTConfig(**SMALL_GPT), optimizer="muon"))
    check_ckpt_path(saved["saved"], GPT(GPTConfig(**SMALL_GPT)))


def test_a_random_huggingface_llama_imports_with_the_same_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit3d import GPT

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        rope_theta=500000.0,
    )
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), learning_rate=1e-4)
    assert (model.config.n_kv_head, model.config.rope_theta, model.learning_rate) == (2, 500000.0, 1e-4)
    tokens = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_an_exported_checkpoint_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    """The DP2 x PP2 checkpoint, written by 4 ranks, becomes one HuggingFace folder."""
    from transformers import AutoModelForCausalLM

    from lit3d import GPT, GPTConfig
    from lit3d.cli import main
    from lit3d.hf.folders import hf_name

    main(["export", "--ckpt_path", str(saved["saved"]), "--output", str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 2
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    # The same weights, read back from the shards directly, in a lit3d model.
    import torch.distributed.checkpoint as dcp

    model = GPT(GPTConfig(**SMALL_GPT))
    model.configure_model()
    state = {f"state_dict.model.{n}": t for n, t in model.model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(saved["saved"]))
    assert torch.equal(
        exported.state_dict()[hf_name("blocks.1.mlp.down_proj.weight")], model.model.blocks["1"].mlp.down_proj.weight
    )
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def test_huggingface_folders_lit3d_cannot_compute_are_refused(tmp_path):
    from lit3d.hf.folders import config_from_hf

    base = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=10,
    )
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not one of linear, llama3, yarn"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}})
    with pytest.raises(ValueError, match="llama3 needs low_freq_factor"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="attention_bias=True"):
        config_from_hf({**base, "attention_bias": True})
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        from lit3d import GPT

        GPT.from_pretrained(str(tmp_path))
