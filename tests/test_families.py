"""The model families people fine-tune, imported from and exported to HuggingFace folders built locally with
transformers: their features computed as transformers computes them."""

import pytest
import torch
from family_layouts import FAMILY_LAYOUTS, reference_of
from helpers import HARMONY, HARMONY_TOKENS, chat_file, chat_tokenizer, tune_adapters
from layouts import FALLS, HALF, STEPS

from lit3d import GPT, GPTConfig
from lit3d.models.rotary import Rope

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip


def _llama31_folder(folder):
    """A tiny Llama 3.1-shaped folder: llama3 rotary scaling up to 131,072 positions, rope_theta 500,000."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_llama3_rotary_scaling_gives_transformers_logits_beyond_the_original_context(tmp_path):
    """Llama 3.1-3.3's rope_scaling: positions past 8,192 (a long tiny sequence) as transformers computes them, and
    the scaling written back on export."""
    from transformers import LlamaForCausalLM

    folder = _llama31_folder(tmp_path / "llama31")
    model = GPT.from_pretrained(str(folder))
    assert model.config.rope_scaling == LLAMA3_SCALING and model.config.max_seq_len == 131072
    tokens = torch.randint(0, 256, (1, 8300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)(input_ids=tokens).logits
        ours = model(tokens)
    assert (ours[0, 8192:] - theirs[0, 8192:]).abs().max() < 1e-4
    assert (ours - theirs).abs().max() < 1e-4
    exported = _exported(model, tmp_path)
    with torch.no_grad():
        again = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)(input_ids=tokens).logits
    assert (again - ours).abs().max() < 1e-4


def _exported(model: GPT, tmp_path) -> str:
    """``model`` saved as a lit3d checkpoint file and exported by ``lit3d export`` to a HuggingFace folder."""
    from lit3d.cli import main

    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, tmp_path / "model.ckpt")
    main(["export", "--ckpt_path", str(tmp_path / "model.ckpt"), "--output", str(tmp_path / "exported")])
    return str(tmp_path / "exported")


def test_the_frequencies_of_each_band_of_llama3_scaling():
    """Short wavelengths kept, long ones divided by the factor, the band between blended."""
    plain = Rope(500000.0).inverse_frequencies(8, torch.device("cpu"))
    scaled = Rope.of(500000.0, LLAMA3_SCALING).inverse_frequencies(8, torch.device("cpu"))
    wavelengths = 2 * torch.pi / plain  # 6.3, 167, 4,455 and 118,700 positions
    assert torch.equal(scaled[:2], plain[:2]) and scaled[3] == pytest.approx(plain[3] / 8)
    assert plain[2] / 8 < scaled[2] < plain[2] and 2048 < wavelengths[2] < 8192
    linear = Rope.of(10000.0, {"rope_type": "linear", "factor": 4.0}).inverse_frequencies(8, torch.device("cpu"))
    assert torch.allclose(linear, Rope(10000.0).inverse_frequencies(8, torch.device("cpu")) / 4)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "dynamic", "factor": 4.0}, "rope_type 'dynamic' is not one of linear, llama3, yarn"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 needs low_freq_factor, high_freq_factor, original_max"),
    ],
)
def test_a_rotary_scaling_lit3d_does_not_compute_is_refused_naming_it(scaling, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(rope_scaling=scaling)


@pytest.mark.parametrize(
    "preset, published",
    [("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496), ("llama3.2-1b", 1_235_814_400),
     ("llama3.2-3b", 3_212_749_824), ("qwen3-8b", 8_190_735_360), ("qwen3-32b", 32_762_123_264),
     ("qwen3-30b-a3b", 30_532_122_624), ("mistral-7b", 7_248_023_552), ("qwen2.5-7b", 7_615_616_512)],
)  # fmt: skip
def test_presets_hold_the_published_parameter_counts(preset, published):
    """The counts of the models' own safetensors indexes (their releases on the HuggingFace hub): exact."""
    assert GPTConfig.from_name(preset).num_params == published


TINY_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
             "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False}  # fmt: skip
GEMMA_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip


def _folder(kind: str, folder, **overrides):
    """A tiny folder of ``kind``, built with transformers: Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms,
    heads wider than d_model / n_head), Qwen3-MoE (its router without renormalisation), Mistral, Mixtral; with BOS/EOS
    ids and a generation config, which an export keeps. ``overrides``: config.json fields changed."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2) | overrides  # fmt: skip
    qwen3 = dict(head_dim=16, rope_parameters={"rope_theta": 1e6})
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, **qwen3),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, **qwen3, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, norm_topk_prob=False),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "mixtral": lambda: transformers.MixtralConfig(**common, sliding_window=None, num_local_experts=4,
                                                      num_experts_per_tok=2),
        # windows of 8 tokens in every block (Mistral v0.1's form), shorter than the tests' sequences
        "mistral_windowed": lambda: transformers.MistralConfig(**common, sliding_window=8),
        # windowed and full blocks, a sink per head, biased attention, a biased router over experts with biases and
        # the clamped SwiGLU, YaRN
        "gpt_oss": lambda: transformers.GptOssConfig(**common | {"intermediate_size": 16}, head_dim=16,
                                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                     rope_parameters=dict(TINY_YARN)),
        # a windowed block (rotary base 10k) and a full one (1M, stretched 8x), four norms per block scaling by
        # 1 + weight, GeGLU, scaled and tied embeddings, query_pre_attn_scalar, soft-capped logits
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                                                             query_pre_attn_scalar=12, final_logit_softcapping=30.0,
                                                             layer_types=["sliding_attention", "full_attention"],
                                                             rope_parameters=GEMMA_ROPE),
    }[kind]()  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a missed one shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                param.uniform_(0.5, 1.5)
    model.generation_config.temperature, model.generation_config.do_sample = 0.7, True
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "kind", ["qwen2", "qwen3", "qwen3_moe", "mistral", "mistral_windowed", "gpt_oss", "gemma3_text"]
)
def test_a_family_imports_and_exports_with_transformers_logits(kind, tmp_path):
    import json

    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = _folder(kind, tmp_path / kind)
    model = GPT.from_pretrained(str(folder))
    config, family = model.config, kind.removesuffix("_windowed")
    assert config.family == family and config.qkv_bias == (kind == "qwen2")
    assert config.qk_norm == kind.startswith(("qwen3", "gemma3"))
    assert config.sliding_window == (8 if kind in ("mistral_windowed", "gpt_oss", "gemma3_text") else None)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)(input_ids=tokens).logits
        ours = model(tokens)
        assert (ours - theirs).abs().max() < 1e-4
        exported = _exported(model, tmp_path)
        written = json.loads((tmp_path / "exported" / "config.json").read_text())
        assert (written["model_type"], written["bos_token_id"], written["eos_token_id"]) == (family, 1, 2)
        assert written["sliding_window"] == config.sliding_window
        if kind in ("gpt_oss", "gemma3_text"):  # which blocks are windowed, as the folder said
            assert written["layer_types"] == ["sliding_attention", "full_attention"]
        assert GenerationConfig.from_pretrained(exported).temperature == 0.7
        again = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)(input_ids=tokens).logits
    assert (again - ours).abs().max() < 1e-4


@pytest.mark.parametrize(
    "kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gpt_oss", "gemma3_text"]
)
@pytest.mark.parametrize("tied", [False, True])
def test_the_planner_counts_a_familys_parameters_as_transformers_does(kind, tied, tmp_path, capsys):
    """It counted 3,346,176 for a Qwen2 of 3,333,888: the embedding and head rows padded to a multiple of 64, which
    the model holds but are not its parameters. A vocabulary of 250 pads 6 rows; a tied head is counted once."""
    import json

    from transformers import AutoModelForCausalLM

    from lit3d.cli import main

    folder = _folder(kind, tmp_path / kind, vocab_size=250, tie_word_embeddings=tied)
    counted = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    main(["plan", "--model", str(folder), "--gpus_per_node", "2", "--gpu", "CPU", "--seq_len", "64", "--json"])
    assert json.loads(capsys.readouterr().out)["params_total"] == counted
    main(["plan", "--model", str(folder), "--gpus_per_node", "2", "--gpu", "CPU", "--seq_len", "64"])
    assert capsys.readouterr().out.startswith(f"lit3d plan: {kind} ({counted / 1e3:.1f}K parameters)")


@pytest.mark.parametrize("layout", [name for name in FAMILY_LAYOUTS if "resumed" not in name])
def test_each_family_trains_like_one_process_in_its_layouts(layout, layout_runs, family_references):
    """Llama 3.2's scaled rotary and tied vocabulary-parallel head, Qwen2's biases (TP-split, ZeRO-1-sliced), Qwen3's
    head norms, Qwen3-MoE's router, DeepSeek-V3's latent attention, grouped sigmoid routing and multi-token
    prediction: each layout's losses within 1e-5 of its own single process (fp32), and DeepSeek-V3's router biases,
    moved by every step's load summed over the ranks, equal to its own."""
    run, reference = layout_runs[layout], family_references[reference_of(layout)]
    assert len(reference["losses"]) == len(run["losses"]) == STEPS
    assert reference["losses"][-1] < reference["losses"][0] - FALLS  # it learns
    for key in ("losses", "val_loss"):
        assert len(run[key]) == len(reference[key]) > 0, key
        assert max(abs(a - b) for a, b in zip(run[key], reference[key])) <= 1e-5, (key, run[key], reference[key])
    _assert_same_router_biases(run, reference)


def _assert_same_router_biases(run: dict, reference: dict) -> None:
    """The router biases a run's ranks hold (`family_layouts.RouterBiases`) are the single process's, every block's
    held somewhere, and moved from zero."""
    expected = reference.get("router_biases")
    if expected is None:
        return
    held = {block: bias for rank in run["ranks"] for block, bias in rank["router_biases"].items()}
    assert held.keys() == expected.keys() and any(any(bias) for bias in expected.values())
    for block, bias in expected.items():
        assert max(abs(a - b) for a, b in zip(held[block], bias)) <= 1e-6, (block, held[block], bias)


def test_qwen2s_zero1_sliced_biases_resume_in_another_layout(layout_runs, family_references):
    """The optimizer states of biases that ZeRO-1 sliced within each TP rank's part are saved in their global places:
    DP2×TP2 at ZeRO-1, resumed at TP2×PP2, goes on along the single-process curve."""
    resumed, reference = layout_runs["qwen2_tp2_pp2_resumed_from_dp2_tp2_zero1"]["losses"], family_references["qwen2"]
    assert len(resumed) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed, reference["losses"][HALF:])) <= 1e-5


def test_deepseek_v3s_expert_parallel_checkpoint_resumes_with_sequence_parallelism(layout_runs, family_references):
    """EP2's checkpoint (each rank's experts, the router biases, their optimizer states) resumed at TP2 with sequence
    parallelism goes on along the single-process curve, and its router biases end as the single process's."""
    resumed = layout_runs["deepseek_v3_tp2_sequence_parallel_resumed_from_ep2"]
    reference = family_references["deepseek_v3"]
    assert len(resumed["losses"]) == STEPS - HALF
    assert max(abs(a - b) for a, b in zip(resumed["losses"], reference["losses"][HALF:])) <= 1e-5
    _assert_same_router_biases(resumed, reference)


def _llama3_tokenizer(folder):
    """A small byte-level BPE tokenizer folder with Llama 3's special tokens: BOS put before every text by its
    post-processor, EOS ``<|eot_id|>``."""
    import json

    from helpers import byte_level_bpe
    from tokenizers import processors

    tokenizer = byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B", special_tokens=[
            ("<|begin_of_text|>", 0)])  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize("family", ["llama3", "qwen"])
def test_a_family_tokenizer_encodes_as_transformers_autotokenizer(family, tmp_path):
    """lit3d's data path encodes a local tokenizer folder exactly as transformers' `AutoTokenizer` does, special
    tokens in the text included, with the family's BOS (Llama 3) or none (Qwen) and its EOS."""
    from helpers import chat_tokenizer
    from transformers import AutoTokenizer

    from lit3d.data.tokenizers import load_tokenizer

    folder = _llama3_tokenizer(tmp_path / "tok") if family == "llama3" else chat_tokenizer(tmp_path / "tok")
    texts = ["the quick brown fox", "  jumps over\nthe lazy dog ", "<|im_start|>user def ( fox<|im_end|>", "ünïcode ✓"]
    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert [list(ids) for ids in ours.encode_batch(texts)] == theirs(texts)["input_ids"]
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.bos_id == (0 if family == "llama3" else None)
    assert ours.decode(ours.encode_batch(texts[1:2])[0][1 if ours.bos_id is not None else 0 :]) == texts[1]


@pytest.mark.parametrize(
    "field, message",
    [({"model_type": "gemma2", "attn_logit_softcapping": 50.0}, "model_type='gemma2'.*attn_logit_softcapping"),
     ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: Gemma's attention logit soft-capping"),
     ({"index_topk": 2048}, "index_topk=2048: DeepSeek-V3.2's sparse attention"),
     ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
     ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "quantization_config=.*mxfp4"),
     ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "sliding_window=4096"),
     ({"model_type": "qwen3_moe", "mlp_only_layers": [1], "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16}, r"decoder_sparse_step=1, mlp_only_layers=\[1\]")],
)  # fmt: skip
def test_a_folder_with_what_lit3d_does_not_compute_is_refused_naming_the_field(field, message):
    from lit3d.hf.folders import config_from_hf

    base = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=10)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        config_from_hf({**base, **field})


def test_lora_on_gpt_oss_trains_and_exports_a_peft_adapter_transformers_loads(tmp_path, capsys):
    """LoRA on a tiny gpt-oss folder's attention (windows, sinks and biases around it): a few steps train the adapters
    only, and ``lit3d export --adapter`` writes a PEFT folder whose adapters on transformers' model give lit3d's
    logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lit3d import LoRA
    from lit3d.cli import main

    folder = _folder("gpt_oss", tmp_path / "hf")
    model = GPT(pretrained=str(folder), lora=LoRA(rank=4, alpha=8, targets=("q", "k", "v", "o")))
    ckpt = tune_adapters(model, 25, tmp_path / "lora.ckpt")
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter"), "--adapter"])
    assert "LoRA adapters (rank 4, q, k, v, o)" in capsys.readouterr().out
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=tokens).logits
        untuned = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=tokens).logits
    assert (ours - theirs).abs().max() < 1e-4 and (ours - untuned).abs().max() > 1e-3


def test_a_gpt_oss_folder_tunes_on_harmony_chat_data_answers_and_exports_with_its_template(
    tmp_path, capsys, monkeypatch
):
    """Item 5 end to end: a tiny gpt-oss folder whose tokenizer has a harmony template (gpt-oss's shape: <|return|>
    ends the last answer, <|end|> an earlier one) tunes with `configs/chat.yaml` (LoRA on its attention and each
    expert); ``generate --chat`` prompts the checkpoint with that template and its generation prompt; the merged export
    keeps the template and transformers reads it with the tuned model's logits."""
    from test_nothing_lost_models import ROOT, one_step
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit3d.cli import main, make_cli

    folder = chat_tokenizer(_folder("gpt_oss", tmp_path / "model", vocab_size=320), HARMONY, HARMONY_TOKENS,
                            eos="<|return|>")  # fmt: skip
    chats = chat_file(tmp_path / "chats.jsonl", 24, max_words=8)
    monkeypatch.chdir(tmp_path)
    make_cli(["fit", "--config", str(ROOT / "configs" / "chat.yaml"), f"--model.pretrained={folder}",
              f"--data.init_args.tokenizer={folder}", f"--data.init_args.data_path={chats}",
              "--data.init_args.seq_len=64", "--model.learning_rate=0.01", "--model.warmup_steps=0",
              *one_step(tmp_path)])  # fmt: skip
    (ckpt,) = tmp_path.rglob("epoch=*.ckpt")
    prompts = []
    generate = GPT.generate

    def recording(self, prompt_tokens, sampling=None, generator=None):
        prompts.append(prompt_tokens[0].tolist())
        return generate(self, prompt_tokens, sampling, generator)

    monkeypatch.setattr(GPT, "generate", recording)
    main(["generate", "--ckpt_path", str(ckpt), "--chat", "--prompt", "why", "--temperature", "0",
          "--max_new_tokens", "4"])  # fmt: skip
    theirs = AutoTokenizer.from_pretrained(folder)
    asked = [{"role": "user", "content": "why"}]
    assert theirs.decode(prompts[0]) == theirs.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged")])
    turns = [*asked, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "how"}]
    ours = AutoTokenizer.from_pretrained(tmp_path / "merged")
    rendered = ours.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "<|channel|>final<|message|>yes<|end|>" in rendered and rendered.endswith("<|start|>assistant")
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tuned = GPT.from_pretrained(str(tmp_path / "merged"))(tokens)
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(input_ids=tokens)
        untuned = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=tokens).logits
    assert (tuned - exported.logits).abs().max() < 1e-4 and (tuned - untuned).abs().max() > 1e-4
