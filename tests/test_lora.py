"""LoRA (`lit3d.models.lora`): adapters that train like PEFT's on the same HuggingFace model, only the adapters
training,
and bad settings refused by name before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_llama
from layouts import HALF, LORA_LAYOUTS, STEPS, is_deep

from lit3d import GPT, GPTConfig, LoRA

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"), vocab_size=128)


def _peft_twin(folder: Path, lora: LoRA, ours: GPT) -> torch.nn.Module:
    """PEFT's LoRA on the same folder, its A copied from ours (B starts at zero in both)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lit3d.models.lora import ROLES

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                        target_modules=[ROLES[t][1].split(".")[-1] for t in lora.targets])  # fmt: skip
    twin = get_peft_model(LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32), config)
    theirs = dict(twin.named_parameters())
    for name, param in ours.model.named_parameters():
        if name.endswith(".lora_a"):
            block, module = name.split(".")[1], ROLES[_role(name)][1]
            key = f"base_model.model.model.layers.{block}.{module}.lora_A.default.weight"
            with torch.no_grad():
                theirs[key].copy_(param)
    return twin


def _role(name: str) -> str:
    from lit3d.models.lora import ROLES

    return next(role for role, (ours, _) in ROLES.items() if f".{ours}." in name)


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")])
def test_ten_steps_equal_peft_on_the_same_huggingface_model(llama_folder, targets):
    lora = LoRA(rank=8, alpha=16, targets=targets)
    torch.manual_seed(0)
    ours = GPT(pretrained=str(llama_folder), lora=lora)
    ours.configure_model()
    twin = _peft_twin(llama_folder, lora, ours)
    trainable = lambda module: [p for p in module.parameters() if p.requires_grad]
    assert len(trainable(ours)) == len(trainable(twin)) == 2 * 2 * len(targets)
    optimizers = [torch.optim.AdamW(trainable(m), lr=1e-2, weight_decay=0.0) for m in (ours, twin)]
    batches = torch.randint(0, 128, (10, 4, 17), generator=torch.Generator().manual_seed(1))
    for batch in batches:
        losses = [ours.loss(batch), twin(input_ids=batch, labels=batch).loss]
        for loss, optimizer in zip(losses, optimizers):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-4)
    with torch.no_grad():
        assert torch.allclose(ours(batches[0]), twin(input_ids=batches[0]).logits, atol=1e-4)


def test_only_the_adapters_train_and_a_fresh_adapter_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    plain = GPT("tiny")
    plain.configure_model()
    torch.manual_seed(0)
    adapted = GPT("tiny", lora={"rank": 4, "targets": ["q", "down"]})  # (as a config file gives it)
    adapted.configure_model()
    tokens = torch.randint(0, 256, (2, 17))
    assert adapted.loss(tokens).item() == plain.loss(tokens).item()  # B starts at zero
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {f"model.blocks.{i}.{m}.lora_{x}" for i in range(4) for m in ("attn.q_proj", "mlp.down_proj")
                         for x in "ab"}  # fmt: skip
    assert adapted.hparams["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.0, "targets": ("q", "down")}


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rank": 0}, r"lora.rank=0 must be a positive integer"),
        ({"targets": ("q", "query")}, r"lora.targets=\['q', 'query'\]: \['query'\] not among q, k, v, o"),
        ({"alpha": -1.0}, r"lora.alpha=-1.0 must be positive"),
        ({"dropout": 1.0}, r"lora.dropout=1.0 in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        GPT("tiny", lora=settings)


def test_each_expert_of_an_moe_layer_has_its_own_adapter_which_merges_into_its_weights(tmp_path):
    """Adapters on gate, up and down give every expert its own A and B, stacked as its weights; merged, a plain
    model computes what the adapted one does; the planner's tensors are the model's; PEFT has no form for them."""
    from lit3d.hf.adapters import merge_adapters, write_adapter
    from lit3d.planner.tensors import parameter_table

    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=64, n_expert=4,
                       n_expert_per_token=2, d_ff_expert=48, first_dense_layers=1)  # fmt: skip
    lora = LoRA(rank=4, targets=("q", "gate", "up", "down"))
    torch.manual_seed(0)
    model = GPT(config, lora=lora)
    model.configure_model()
    experts = model.model.blocks["1"].mlp.experts
    assert experts.down_proj_lora_a.shape == (4, 48, 4) and experts.down_proj_lora_b.shape == (4, 4, 32)
    trained = {name for name, p in model.model.named_parameters() if p.requires_grad}
    assert "blocks.1.mlp.experts.gate_proj_lora_b" in trained and "blocks.1.mlp.experts.gate_proj" not in trained
    planned = {t.name: t.shape for t in parameter_table(config, lora)}
    assert planned == {name: tuple(p.shape) for name, p in model.model.named_parameters()}
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.1)
        tokens = torch.randint(0, 64, (2, 12))
        adapted = model(tokens)
        plain = GPT(config)
        plain.configure_model()
        plain.model.load_state_dict(merge_adapters(model.model.state_dict(), lora))
        assert torch.allclose(plain(tokens), adapted, atol=1e-5)
        assert not torch.allclose(GPT(config, lora=lora).to(tokens.device)(tokens), adapted, atol=1e-3)
    with pytest.raises(ValueError, match="have no PEFT form for transformers' fused experts: export the merged"):
        write_adapter(tmp_path / "adapter", model.model.state_dict(), lora, None)


@pytest.mark.parametrize("layout", [name for name in LORA_LAYOUTS if "resumed" not in name])
def test_lora_trains_like_one_process_in_every_layout(layout, layout_runs, request):
    """Loss and val loss within 1e-5 of the single process (fp32), the frozen base split as any weight is, with
    dropout 0.1 on the adapters' inputs: every layout drops what one process drops (an accumulating run validates on
    smaller micro-batches, other blocks: its losses only)."""
    job = LORA_LAYOUTS[layout][1]
    kind = "moe_" if "moe" in layout else "long_" if "cp" in layout else "deep_" if is_deep(job) else ""
    reference = request.getfixturevalue(f"reference_lora_{kind}run")
    run = layout_runs[layout]
    assert len(reference["losses"]) == len(run["losses"]) == STEPS
    # the adapters learn (from B = 0, slowly: by more than 0.01 over these steps), 1000 times the tolerance below
    assert reference["losses"][-1] < reference["losses"][0] - 0.01
    for key in ("losses",) if "accumulate" in layout else ("losses", "val_loss"):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, key


def test_dropout_masks_follow_each_elements_place_in_the_run_not_the_layout():
    """What a rank holds of a batch (every R-th row, a micro-batch, a CP rank's chunks, a slice of the features) is
    dropped as one process drops those elements; each adapter has masks of its own, and ``p`` of the elements drop."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from lit3d.models.batch_context import BatchContext
    from lit3d.models.lora_dropout import LayoutFreeDropout, Samples, keep_mask
    from lit3d.models.ring_attention import ContextParallel

    dropout = LayoutFreeDropout(0.25).train()
    dropout.name = "blocks.0.attn.q_proj.dropout"
    x = torch.ones(4, 8, 6)
    samples = Samples.strided(first=40, stride=1, count=4, seed=7)  # one process: the global batch's 4 rows
    whole = dropout(x, samples)
    assert torch.equal(whole.unique(), torch.tensor([0.0, 1 / 0.75]))  # scaled as torch.nn.Dropout scales
    _, micro_batches = split_args_kwargs_into_chunks((), BatchContext(samples=samples).keywords(), 2)
    assert torch.equal(dropout(x[2:], micro_batches[1]["context"].samples), whole[2:])  # a pipeline's second
    assert torch.equal(dropout(x[1::2], Samples.strided(41, 2, 2, seed=7)), whole[1::2])  # data-parallel replica 1 of 2
    dropout.context_parallel = ContextParallel(None, 2, 1)  # CP rank 1 of 2 holds chunks 1 and 2 of 4
    assert torch.equal(dropout(x[:, 2:6], samples), whole[:, 2:6])
    keys = dropout.token_keys(samples, 4, 4, x.device)
    features = torch.arange(6)
    assert torch.equal(keep_mask(keys, features[3:], 0.25), keep_mask(keys, features, 0.25)[..., 3:])  # TP
    other = LayoutFreeDropout(0.25).train()
    other.name = "blocks.0.attn.v_proj.dropout"
    assert not torch.equal(other(x[:, 2:6], samples), whole[:, 2:6])
    dropout.context_parallel = None
    many = dropout(torch.ones(64, 32, 64), Samples.strided(0, 1, 64, seed=7))
    assert (many == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)


@pytest.mark.parametrize("shares", [None, (6, 2)])
def test_each_replica_keys_its_rows_by_the_samples_the_sampler_deals_it(shares):
    """Replica r's rows at micro-step m of optimizer step s are the samples the sampler deals it there, numbered in the
    run (s x global batch + their place in it), with or without `data_parallel_shares`."""
    from types import SimpleNamespace

    from lit3d.data.sampler import GlobalBatchSampler
    from lit3d.models.lora_dropout import training_samples

    step, accumulate, replicas, batch = 3, 2, 2, 8
    for replica in range(replicas):
        sampler = GlobalBatchSampler(range(64), batch, replicas, replica, shuffle=False, shares=shares)
        dealt = sampler.mine(torch.arange(batch)).view(accumulate, -1)  # its samples of each global batch, by step
        trainer = SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": replicas, "rank": replica},
            accumulate_grad_batches=accumulate,
            strategy=SimpleNamespace(parallelism=SimpleNamespace(data_parallel_shares=shares)),
            global_step=step,
        )
        for micro_step, samples in enumerate(dealt):
            keyed = training_samples(trainer, batch_idx=10 * accumulate + micro_step, rows=len(samples))
            assert torch.equal(keyed.ids, step * batch + samples), (replica, micro_step)


def test_the_fused_mask_gpus_compile_is_the_eager_one():
    """GPUs draw the masks with one compiled kernel (`lit3d.models.lora_dropout.fused_keep`), the CPU in eager passes
    over
    slices of rows: the same bits (compiled here for the CPU)."""
    from lit3d.models.lora_dropout import fused_keep, keep_mask, mix

    keys, features = mix(torch.arange(300) * 7919), torch.arange(40, 97)
    fused = fused_keep()(keys, mix(features ^ 0x9E3779B9), int(0.1 * 2**32))
    assert torch.equal(fused, keep_mask(keys, features, 0.1)) and 0.05 < 1 - fused.float().mean() < 0.15


def test_offload_keeps_the_sharded_states_in_host_memory(layout_runs):
    """ZeRO-3 with offload=True: every FSDP2 unit runs PyTorch's CPU offload policy (its loss curve is the single
    process's: `test_lora_trains_like_one_process_in_every_layout`). On this CPU machine host and device are one, so
    where the states live is asked of FSDP2's policy, not of the tensors."""
    run = layout_runs["lora_dp2_zero3_offload"]
    assert run["offload_policies"] == ["CPUOffloadPolicy"]
    assert run["optimizer_state_devices"] == ["cpu"]


def test_the_flops_of_a_lora_model_count_its_adapters():
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=64),
                lora=LoRA(rank=4, targets=("q", "o", "down")))  # fmt: skip
    model.configure_model()
    assert model.adapter_params == sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name) > 0
    assert GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, d_ff=64, vocab_size=64)).adapter_params is None


def test_offload_needs_zero3():
    from lit3d.parallel.settings import Parallelism

    with pytest.raises(ValueError, match="offload=True with zero_stage=1: offloading to the CPU needs zero_stage=3"):
        Parallelism(offload=True)
    with pytest.raises(ValueError, match="offload=True with expert_parallel_size=2: experts split over ranks"):
        Parallelism(offload=True, zero_stage=3, expert_parallel_size=2)


def _trained(folder: Path, lora: LoRA, path: Path) -> tuple[GPT, Path]:
    """A LoRA GPT on ``folder`` after three steps (so B is no longer zero), saved as one checkpoint file."""
    torch.manual_seed(0)
    model = GPT(pretrained=str(folder), lora=lora)
    model.configure_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in torch.randint(0, 128, (3, 4, 17), generator=torch.Generator().manual_seed(2)):
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, path)
    return model, path


def test_the_adapter_exports_as_a_peft_folder_and_the_merged_model_as_a_plain_one(llama_folder, tmp_path, capsys):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lit3d.cli import main

    model, ckpt = _trained(llama_folder, LoRA(rank=4, alpha=8, targets=("q", "v", "down")), tmp_path / "lora.ckpt")
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter"), "--adapter"])
    assert "LoRA adapters (rank 4, q, v, down)" in capsys.readouterr().out
    base = LlamaForCausalLM.from_pretrained(llama_folder, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4)
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged")])
    assert "LoRA adapters (rank 4) merged into their linears" in capsys.readouterr().out
    with torch.no_grad():
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)(input_ids=tokens)
    assert torch.allclose(ours, merged.logits, atol=1e-4)
    resumed = GPT(pretrained=str(llama_folder), adapter=str(tmp_path / "adapter"))  # its settings from the folder
    assert resumed.lora == model.lora
    with torch.no_grad():
        assert torch.allclose(resumed(tokens), ours, atol=1e-5)
    with pytest.raises(ValueError, match=r"differs from the adapter .*'s settings"):
        GPT(pretrained=str(llama_folder), adapter=str(tmp_path / "adapter"), lora=LoRA(rank=8))


def test_an_adapter_trained_from_a_relative_folder_names_its_base_by_an_absolute_path(
    llama_folder, tmp_path, monkeypatch
):
    """Issue 63, item 6: ``GPT(pretrained="model")`` (relative, as a CLI user types it) exports an adapter whose
    ``base_model_name_or_path`` is the folder's absolute path, so ``AutoPeftModelForCausalLM`` loads it from anywhere
    instead of asking a hub for ``model``."""
    import json

    from peft import AutoPeftModelForCausalLM

    from lit3d.cli import main

    monkeypatch.chdir(llama_folder.parent)
    model, ckpt = _trained(Path(llama_folder.name), LoRA(rank=4, alpha=8, targets=("q", "v")), tmp_path / "lora.ckpt")
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter"), "--adapter"])
    base = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(llama_folder.resolve())
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative name would not be found
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", torch_dtype=torch.float32)
        assert torch.allclose(model(tokens), theirs(input_ids=tokens).logits, atol=1e-4)


def test_exporting_the_adapter_of_a_run_without_one_is_refused(llama_folder, tmp_path):
    from lit3d.cli import main

    plain = GPT(pretrained=str(llama_folder))
    plain.configure_model()
    torch.save({"hyper_parameters": dict(plain.hparams), "state_dict": plain.state_dict()}, tmp_path / "plain.ckpt")
    with pytest.raises(SystemExit, match=r"was trained without LoRA adapters: export it without --adapter"):
        main(["export", "--ckpt_path", str(tmp_path / "plain.ckpt"), "--output", str(tmp_path / "x"), "--adapter"])


def test_a_lora_checkpoint_saved_at_tp2_resumes_at_pp2_on_the_same_curve(layout_runs, reference_lora_run):
    resumed, reference = layout_runs["lora_pp2_resumed_from_tp2"]["losses"], reference_lora_run["losses"]
    assert len(resumed) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, reference[HALF:])) <= 1e-5
