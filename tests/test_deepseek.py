"""DeepSeek-V3 (Kimi K2, Moonlight): multi-head latent attention, YaRN and DeepSeekMoE's group-limited routing, imported
from and exported to HuggingFace ``deepseek_v3`` folders built locally with transformers, and computed as transformers
computes them; the folders and settings lit3d does not compute refused, naming the field."""

import json

import pytest
import torch
from helpers import tune_adapters
from safetensors import safe_open

from lit3d import GPT, GPTConfig
from lit3d.models.batch_context import BatchContext
from lit3d.models.documents import Documents

# YaRN as DeepSeek-V3 stretches 4k to 16k positions: the pretrained context in a band of the rotated dims, and a
# softmax temperature (mscale_all_dim) besides the attention factor on cos and sin.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707}  # fmt: skip
PLAIN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}  # the default temperature


def _deepseek(q_lora_rank: int | None, rope: dict):
    """A tiny DeepSeek-V3 with transformers: latent attention (queries through a low-rank pair, or one q_proj),
    8 routed experts in 2 groups (tokens choose 2 of the best group's 4), one shared expert, one dense first block,
    YaRN; weights large enough to make the routing and the attention matter, norms away from 1, a balancing bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=32,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, rms_norm_eps=1e-5,
        max_position_embeddings=16384, initializer_range=0.1, rope_parameters={"rope_theta": 10000.0, **rope},
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.2, 0.2)
    return model


def _with_mtp_layer(folder) -> None:
    """Add a multi-token-prediction layer to ``folder`` as DeepSeek-V3's checkpoints hold it (``model.layers.{N}``, N
    the number of blocks: an MoE block's weights, here the last block's perturbed, with ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and copies of the embedding and the head), which transformers' model ignores."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    n, d, generator = config["num_hidden_layers"], config["hidden_size"], torch.Generator().manual_seed(5)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    layer = {name.replace(last, mtp): t * (1 + 0.2 * torch.randn(t.shape, generator=generator))
             for name, t in tensors.items() if name.startswith(last)}  # fmt: skip
    layer |= {f"{mtp}{name}.weight": 0.5 + torch.rand(d, generator=generator)
              for name in ("enorm", "hnorm", "shared_head.norm")}  # fmt: skip
    layer |= {f"{mtp}eh_proj.weight": 0.1 * torch.randn(d, 2 * d, generator=generator),
              f"{mtp}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
              f"{mtp}shared_head.head.weight": tensors["lm_head.weight"].clone()}  # fmt: skip
    save_file(tensors | layer, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))


def _exported(model: GPT, tmp_path) -> str:
    """``model`` saved as a lit3d checkpoint file and exported by ``lit3d export`` to a HuggingFace folder."""
    from lit3d.cli import main

    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, tmp_path / "model.ckpt")
    main(["export", "--ckpt_path", str(tmp_path / "model.ckpt"), "--output", str(tmp_path / "exported")])
    return str(tmp_path / "exported")


@pytest.mark.parametrize("q_lora_rank, rope", [(48, YARN), (None, PLAIN_YARN)], ids=["q_lora", "q_proj"])
def test_a_deepseek_v3_folder_imports_and_exports_with_transformers_logits(q_lora_rank, rope, tmp_path):
    """Logits within 1e-4 of transformers' on 300 tokens, in and back out; the folder's multi-token-prediction layer
    is imported (and left out of the export, which transformers' model does not read), and its balancing bias is the
    router's buffer."""
    from transformers import AutoModelForCausalLM

    reference = _deepseek(q_lora_rank, rope)
    reference.save_pretrained(tmp_path / "hf")
    _with_mtp_layer(tmp_path / "hf")
    model = GPT.from_pretrained(str(tmp_path / "hf"))
    config = model.config
    assert (config.family, config.kv_lora_rank, config.q_lora_rank, config.head_dim) == (
        "deepseek_v3",
        32,
        q_lora_rank,
        48,
    )
    assert (config.n_group, config.topk_group, config.routed_scaling_factor, config.router) == (2, 1, 2.5, "sigmoid")
    assert config.rope_interleave and config.rope_scaling == rope and config.first_dense_layers == 1
    assert config.num_params == sum(p.numel() for p in reference.parameters())  # (the published count: without MTP)
    assert config.num_nextn_predict_layers == 1 and model.model.mtp["0"].eh_proj.weight.shape == (64, 128)
    bias = model.model.blocks["2"].mlp.router.expert_bias
    assert torch.equal(bias, reference.model.layers[2].mlp.gate.e_score_correction_bias)
    tokens = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = reference(input_ids=tokens).logits
        ours = model(tokens)
        assert (ours - theirs).abs().max() < 1e-4
        exported = _exported(model, tmp_path)
        written = json.loads((tmp_path / "exported" / "config.json").read_text())
        assert (written["model_type"], written["num_nextn_predict_layers"]) == ("deepseek_v3", 0)
        names = safe_open(f"{exported}/model.safetensors", "pt").keys()
        assert not [name for name in names if name.startswith("model.layers.3.")]
        again = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)(input_ids=tokens).logits
    assert (again - ours).abs().max() < 1e-4


def test_the_group_limited_router_chooses_and_weighs_as_transformers():
    """16 experts in 4 groups, 4 chosen from the best 2 groups (by the sum of each group's two best biased scores),
    weights renormalised and scaled by 2.5; the bias a buffer, saved with the weights but no parameter."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from lit3d.models.moe import Router

    theirs = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                                   n_group=4, topk_group=2, routed_scaling_factor=2.5))  # fmt: skip
    ours = Router(GPTConfig(d_model=32, n_head=4, n_expert=16, n_expert_per_token=4, router="sigmoid", n_group=4,
                            topk_group=2, routed_scaling_factor=2.5))  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.uniform_(-0.3, 0.3)
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(256, 32)
    chosen, weights, _ = ours(x)
    _, their_weights, their_chosen = theirs(x)
    order, their_order = chosen.argsort(dim=-1), their_chosen.argsort(dim=-1)
    assert torch.equal(chosen.gather(-1, order), their_chosen.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order))
    assert (
        max(len(set(groups)) for groups in (chosen // 4).tolist()) == 2 and (weights.sum(-1) - 2.5).abs().max() < 1e-5
    )
    ours.groups = 1  # without the groups, some tokens choose otherwise
    assert not torch.equal(ours(x)[0].sort(dim=-1).values, chosen.sort(dim=-1).values)
    assert "expert_bias" in ours.state_dict() and "expert_bias" not in dict(ours.named_parameters())


MLA = dict(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=64, max_seq_len=64, kv_lora_rank=16, q_lora_rank=24,
           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, rope_interleave=True, family="deepseek_v3",
           rope_scaling={**YARN, "original_max_position_embeddings": 16})  # fmt: skip


def test_a_packed_row_gives_each_document_what_it_has_alone_under_latent_attention():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MLA, init_std=0.2))
    model.configure_model()
    lengths = [5, 17, 1, 30, 11]
    tokens = torch.randint(0, 64, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model.model(tokens[None], context=BatchContext(Documents.of(positions[None])))[0]
        alone = torch.cat([model.model(part[None])[0] for part in tokens.split(lengths)])
        whole = model.model(tokens[None])[0]
    assert (packed - alone).abs().max() < 1e-5
    assert (whole - alone).abs().max() > 1e-2  # without the mask the documents would see each other


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_latent_attention_splits_its_per_head_projections_over_tensor_parallelism(q_lora_rank):
    """The up-projections column-parallel, o_proj row-parallel, the down-projections and their norms whole; every
    pattern names modules of the network."""
    from lit3d.models.tp_plan import tensor_parallel_plan
    from lit3d.models.transformer import Transformer
    from lit3d.strategies.split.tensor_parallel import check_plan

    config = GPTConfig(**MLA | {"q_lora_rank": q_lora_rank})
    prefix = "blocks.*.attn."
    plan = {key.removeprefix(prefix): role for key, role in tensor_parallel_plan(config).items() if prefix in key}
    queries = {"q_a_proj": "replicated", "q_a_layernorm": "replicated", "q_b_proj": "colwise"}
    if q_lora_rank is None:
        queries = {"q_proj": "colwise"}
    latent = {"kv_a_proj_with_mqa": "replicated", "kv_a_layernorm": "replicated", "kv_b_proj": "colwise"}
    assert plan == {**queries, **latent, "o_proj": "rowwise"}
    with torch.device("meta"):
        check_plan(Transformer(config), tensor_parallel_plan(config))


def test_lora_adapts_latent_attentions_projections():
    from lit3d import LoRA

    model = GPT(GPTConfig(**MLA), lora=LoRA(rank=4, targets=("q_a", "q_b", "kv_a", "kv_b", "o")))
    model.configure_model()
    adapted = {name.split(".")[3] for name, p in model.model.named_parameters() if p.requires_grad}
    assert adapted == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}


@pytest.mark.parametrize(
    "fields, message",
    [({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
      r"quantization_config=.*weight_block_size=\[128, 128\]"),
     ({"index_topk": 2048, "index_n_heads": 64}, "index_topk=2048: DeepSeek-V3.2's sparse attention"),
     ({"model_type": "deepseek_v32", "index_topk": 2048}, "model_type='deepseek_v32'.*index_topk"),
     ({"scoring_func": "softmax"}, "scoring_func='softmax' is not computed"),
     ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy' is not computed"),
     ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not computed")],
)  # fmt: skip
def test_a_deepseek_folder_with_what_lit3d_does_not_compute_is_refused_naming_the_field(fields, message, tmp_path):
    """Before anything is built: `GPT(pretrained=...)` reads the config.json alone."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config_json() | fields))
    with pytest.raises(ValueError, match=message):
        GPT(pretrained=str(folder))


def _config_json() -> dict:
    return dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, vocab_size=256, kv_lora_rank=32, q_lora_rank=None,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                n_group=1, topk_group=1, rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                max_position_embeddings=131072)  # fmt: skip


def test_kimi_k2s_config_is_deepseek_v3s():
    """Kimi K2's config.json holds DeepSeek-V3's fields under model_type kimi_k2 (its rotary scaling by ``type``)."""
    from lit3d.hf.config import config_from_hf

    kimi, deepseek = config_from_hf(_config_json() | {"model_type": "kimi_k2"}), config_from_hf(_config_json())
    assert kimi == deepseek and kimi.family == "deepseek_v3" and kimi.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize(
    "fields, message",
    [(dict(n_expert=8, router="softmax", n_group=2), "groups are for the sigmoid router"),
     (dict(n_expert=8, router="sigmoid", n_group=3), "n_group must divide n_expert"),
     (dict(n_expert=8, n_expert_per_token=5, router="sigmoid", n_group=2), "more than the 4 experts"),
     (dict(q_lora_rank=16), "set kv_lora_rank too"),
     (dict(kv_lora_rank=16, n_kv_head=2), "n_kv_head = n_head=4")],
)  # fmt: skip
def test_routing_and_latent_attention_settings_that_do_not_fit_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_head=4, **fields)


def test_a_multi_token_prediction_layer_computes_as_transformers_mtp_model(tmp_path):
    """The folder's MTP layer, imported: depth 1 reads the decoder's final hidden state and the next token's embedding,
    and its logits are transformers' `MtpModel`'s within 1e-4 on 40 tokens; its loss is their cross-entropy against
    the token after next."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    _deepseek(48, YARN).save_pretrained(tmp_path / "hf")
    _with_mtp_layer(tmp_path / "hf")
    main = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    # NOTE: transformers finds the MTP layer by the pattern DeepSeek-V3's model ignores (layer 61 of the full size)
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    theirs = MtpModel.from_pretrained(main).eval()
    model = GPT.from_pretrained(str(tmp_path / "hf"))
    tokens, seq = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(1)), 40
    with torch.no_grad():
        hidden = main.model(input_ids=tokens[:, :seq]).last_hidden_state
        positions = torch.arange(seq)[None].expand(2, seq)
        expected = theirs.shared_head(theirs.forward_layer(0, hidden, positions, None, input_ids=tokens[:, 1:]))
        network, depth = model.model, model.model.mtp["0"]
        x = network.embed(tokens[:, :seq])
        for block in network.blocks.values():
            x = block(x)
        logits = network.head(depth(network.norm(x), network.embed(tokens[:, 1:])))[..., :256]
    assert (logits - expected).abs().max() < 1e-4
    model.train()
    model.loss(tokens)
    expected_loss = torch.nn.functional.cross_entropy(expected[:, :-1].flatten(0, 1), tokens[:, 2:].flatten())
    assert depth.stats.item() == pytest.approx(expected_loss.item(), abs=1e-5)


def test_a_folder_that_asks_for_multi_token_prediction_without_its_layers_has_none(tmp_path):
    """transformers writes num_nextn_predict_layers=1 into every DeepSeek-V3 folder it saves, with no MTP layer."""
    _deepseek(None, PLAIN_YARN).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert GPT(pretrained=str(tmp_path / "hf")).config.num_nextn_predict_layers == 0


def test_each_depth_reads_the_token_k_ahead_and_predicts_the_one_after():
    """Depth k at input i: the embedding of token i + k, the target token i + k + 1; none past the row's end, past the
    input's document's end, or where the loss mask drops the target; each depth's scale its row over its targets."""
    from lit3d.models.mtp import tokens_ahead
    from lit3d.models.transformer import IGNORED

    tokens = torch.arange(10, 19)[None]  # 9 tokens: 8 inputs and their next tokens
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    ahead = tokens_ahead(inputs, targets, 2)
    assert ahead.tokens[0, :, 0].tolist() == [11, 12, 13, 14, 15, 16, 17, 0]
    assert ahead.tokens[0, :, 1].tolist() == [12, 13, 14, 15, 16, 17, 0, 0]
    x = IGNORED
    assert ahead.targets[0, :, 0].tolist() == [12, 13, 14, 15, 16, 17, 18, x]
    assert ahead.targets[0, :, 1].tolist() == [13, 14, 15, 16, 17, 18, x, x]
    assert ahead.scales.tolist() == [pytest.approx([8 / 7, 8 / 6])]
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])  # documents of 5 and 4 tokens
    targets[0, 1] = IGNORED  # a loss mask's: token 12 is not trained
    ahead = tokens_ahead(inputs, targets, 2, positions, loss_scale=torch.tensor(3.0))
    assert ahead.targets[0, :, 0].tolist() == [x, 13, 14, x, x, 17, 18, x]
    assert ahead.targets[0, :, 1].tolist() == [13, 14, x, x, x, 18, x, x]
    assert ahead.scales.tolist() == [pytest.approx([3 * 8 / 7, 3 * 8 / 6])]


def test_the_objective_adds_the_depths_loss_with_its_weight(tmp_path, text_folder):
    """A training step's objective is the next-token loss (logged as train_loss) plus mtp_loss_weight times the mean
    of the depths' losses (logged as train_mtp_loss), which trains the depths; evaluation computes the next token's
    loss alone."""
    import lightning as L
    from helpers import fit, logged

    from lit3d.data import TextDataModule

    class Objectives(L.Callback):
        def __init__(self) -> None:
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            depths = [depth.stats.item() for depth in pl_module.model.mtp_depths()]
            self.seen.append((outputs["loss"].item(), sum(depths) / len(depths)))

    L.seed_everything(0)
    model = GPT(GPTConfig(**MLA | {"vocab_size": 256}, num_nextn_predict_layers=2, mtp_loss_weight=0.5))
    model.configure_model()
    before = model.model.mtp["1"].eh_proj.weight.detach().clone()
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model.loss(tokens)
    assert [depth.depth for depth in model.model.mtp_depths()] == [1, 2]
    with torch.no_grad():
        assert model.loss(tokens) == loss.detach()  # (the next token's alone)
    probe, data = Objectives(), TextDataModule(str(text_folder), seq_len=16, global_batch_size=2)
    _, log_dir = fit(model, data, tmp_path, max_steps=3, callbacks=[probe])
    losses, depths = logged(log_dir, "train_loss"), logged(log_dir, "train_mtp_loss")
    assert len(losses) == len(depths) == 3
    for (objective, depth), loss, logged_depth in zip(probe.seen, losses, depths):
        assert depth == pytest.approx(logged_depth, abs=1e-6)
        assert objective == pytest.approx(loss + 0.5 * depth, abs=1e-5)
    assert not torch.equal(model.model.mtp["1"].eh_proj.weight, before)


def test_multi_token_prediction_splits_its_blocks_as_the_decoders_under_tensor_parallelism():
    """Each depth's block takes the decoder's rules for its kind (an MoE block in an MoE model), its norms run on
    sequence shards, eh_proj whole; every pattern names modules of the network."""
    from lit3d.models.tp_plan import tensor_parallel_plan
    from lit3d.models.transformer import Transformer
    from lit3d.strategies.split.tensor_parallel import check_plan

    config = GPTConfig(**MLA, num_nextn_predict_layers=2, n_expert=4, first_dense_layers=1)
    plan = {key: role for key, role in tensor_parallel_plan(config).items() if key.startswith("mtp.")}
    assert plan["mtp.*.block.attn.kv_b_proj"] == "colwise" and plan["mtp.*.block.mlp"] == "replicated_region"
    assert plan["mtp.*.eh_proj"] == "replicated_region" and plan["mtp.*.enorm"] == plan["mtp.*.norm"] == "norm"
    with torch.device("meta"):
        check_plan(Transformer(config), tensor_parallel_plan(config))


def test_a_pipelines_stages_hand_the_embeddings_ahead_to_the_depths_on_the_last():
    """The stage with the embedding returns the hidden state and the embeddings of the tokens ahead, which a middle
    stage hands on and the last stage's depths read: the stages' logits and depth losses are the whole network's."""
    from lit3d.models.batch_context import BatchContext
    from lit3d.models.mtp import tokens_ahead
    from lit3d.strategies.pipelining.chunks import stage_view

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MLA | {"n_layer": 3}, num_nextn_predict_layers=2))
    model.configure_model()
    network, tokens = model.model, torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    context = BatchContext(ahead=tokens_ahead(tokens[:, :-1], tokens[:, 1:], 2))
    whole = network(tokens[:, :-1], context=context)
    losses = [depth.stats for depth in network.mtp_depths()]
    first, middle, last = (stage_view(network, [str(i)], i == 0, i == 2) for i in range(3))
    hidden, ahead = first(tokens[:, :-1], context=context)
    assert ahead.shape == (2, 16, 2, 32)
    logits = last(*middle(hidden, ahead, context=context), context=context)
    assert torch.equal(logits, whole)
    assert [depth.stats for depth in network.mtp_depths()] == losses


@pytest.mark.parametrize(
    "fields, message",
    [({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers=-1 and mtp_loss_weight=0.3 must not be negative"),
     ({"num_nextn_predict_layers": 1, "mtp_loss_weight": -0.1}, "mtp_loss_weight=-0.1 must not be negative")],
)  # fmt: skip
def test_multi_token_prediction_settings_out_of_range_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_rows_too_short_for_the_depths_are_refused_naming_both():
    from lit3d.models.mtp import tokens_ahead

    tokens = torch.arange(4)[None]
    with pytest.raises(ValueError, match="num_nextn_predict_layers=3 needs rows of more than 3 tokens; got 3"):
        tokens_ahead(tokens[:, :-1], tokens[:, 1:], 3)


def test_lora_on_latent_attention_trains_and_exports_a_peft_adapter_transformers_loads(tmp_path, capsys):
    """LoRA on a Moonlight-shaped folder's latent attention (``q_proj``, ``kv_b_proj``, ``o_proj``: Moonlight has no
    query low rank): a few steps train the adapters only, and ``lit3d export --adapter`` writes a PEFT folder whose
    adapters on transformers' model give lit3d's logits."""
    from peft import PeftModel
    from transformers import DeepseekV3ForCausalLM

    from lit3d import LoRA
    from lit3d.cli import main

    _deepseek(None, PLAIN_YARN).save_pretrained(tmp_path / "hf")
    model = GPT(pretrained=str(tmp_path / "hf"), lora=LoRA(rank=4, alpha=8, targets=("q", "kv_b", "o")))
    ckpt = tune_adapters(model, 33, tmp_path / "lora.ckpt")
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter"), "--adapter"])
    assert "LoRA adapters (rank 4, q, o, kv_b)" in capsys.readouterr().out
    base = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        ours = model(tokens)
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=tokens).logits
        base_logits = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(input_ids=tokens)
    assert (ours - theirs).abs().max() < 1e-4 and (ours - base_logits.logits).abs().max() > 1e-3


def test_the_page_of_deepseek_s_own_cluster_shows_its_layout_fitting():
    """DeepSeek-V3 as it trained: 2,048 H800s, PP16 x EP64 x DP128 at ZeRO-1 with every block recomputed
    (docs/deepseek-v3.md plans the same layout from the command line): the planner's page holds it, fitting, with
    its 16 stages."""
    from lit3d.planner import Cluster
    from lit3d.planner.explore import explore, layout_key
    from lit3d.planner.hardware import identify

    cluster = Cluster.of(identify("H800"), nodes=256, gpus_per_node=8)
    page = explore("deepseek-v3", cluster, seq_len=4096, global_batch_size=15360, activation_checkpointing="full")
    entry = page.data["layouts"][layout_key(128, 1, 16, 64, 1, 1)]
    assert entry["fits"] and len(entry["stages"]) == 16 and entry["memory"] < 76.5e9
    assert page.data["model"]["name"] == "deepseek-v3" and page.data["cluster"]["gpus"] == 2048
