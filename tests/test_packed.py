"""Chat data and packed documents: answers only, the global answer-token mean in every layout, documents kept apart
(also by the context-parallel ring), and the refusals."""

import json

import numpy as np
import pytest
import torch
from helpers import HARMONY, HARMONY_TOKENS, chat_file, chat_tokenizer, logged, tiny_llama
from layouts import CHAT_GPT, PACKED_LAYOUTS, STEPS

from lit3d import GPT, GPTConfig
from lit3d.data import ChatDataModule, TextDataModule
from lit3d.data.chat_template import ChatTemplate
from lit3d.data.prompts import AnswerDecoder, end_of_turn_ids
from lit3d.models import documents
from lit3d.models.batch_context import BatchContext
from lit3d.models.transformer import IGNORED


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer")


def test_only_the_answers_and_their_end_of_turn_are_trained(tokenizer):
    chat = ChatTemplate(tokenizer)
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"},
             {"role": "assistant", "content": "yes"}, {"role": "user", "content": "how"},
             {"role": "assistant", "content": "the quick fox"}]  # fmt: skip
    ids, answer = chat.encode(turns)
    decode = chat.tokenizer.decode
    assert decode(ids.tolist(), skip_special_tokens=False) == chat.render(turns)
    trained = decode(ids[answer].tolist(), skip_special_tokens=False)
    assert trained == "yes<|im_end|>\nthe quick fox<|im_end|>\n"
    assert 0 < answer.sum() < len(ids) and not answer[:8].any()


def test_harmony_answers_are_trained_with_the_marker_that_ends_each_in_the_whole_conversation(tmp_path):
    """gpt-oss's harmony format ends the last answer with <|return|> and an earlier one with <|end|>: rendered up to an
    earlier answer, the conversation does not begin the whole one, yet each answer is told apart."""
    chat = ChatTemplate(chat_tokenizer(tmp_path / "harmony", HARMONY, HARMONY_TOKENS, eos="<|return|>"))
    turns = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"},
             {"role": "user", "content": "how"}, {"role": "assistant", "content": "the quick fox"}]  # fmt: skip
    assert not chat.render(turns).startswith(chat.render(turns[:2]))
    ids, answer = chat.encode(turns)
    decode = chat.tokenizer.decode
    assert decode(ids.tolist(), skip_special_tokens=False) == chat.render(turns)
    trained = decode(ids[answer].tolist(), skip_special_tokens=False)
    assert trained == "<|channel|>final<|message|>yes<|end|><|channel|>final<|message|>the quick fox<|return|>"
    assert chat.render(turns[:3], add_generation_prompt=True).endswith("<|end|><|start|>assistant")
    # `lit3d generate --chat` prints the final channel's message alone, whatever the model wrote before it
    stop = end_of_turn_ids(chat, [chat.folder])
    made = "<|channel|>analysis<|message|>why not<|end|><|start|>assistant<|channel|>final<|message|>yes<|return|>no"
    assert AnswerDecoder(chat, stop).decode(chat.tokenizer.encode(made, add_special_tokens=False).ids) == "yes"
    rows = tmp_path / "chat.jsonl"
    rows.write_text("\n".join(json.dumps({"messages": turns}) for _ in range(8)))
    data = ChatDataModule(str(rows), str(tmp_path / "harmony"), seq_len=64, global_batch_size=2, val_fraction=0.25)
    data.setup("fit")
    assert next(iter(data.train_dataloader()))["loss_mask"].any()  # (rows of answers to train on)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"messages": [{"role": "bot", "content": "hi"}]}], "turn 0: role 'bot' is not one of"),
        ([{"text": "hi"}], "has columns ['text']: chat data needs 'messages', or 'prompt' and 'response'"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "has no assistant turn"),
    ],
)
def test_bad_chat_rows_are_refused_naming_the_value(tokenizer, tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ChatDataModule(str(path), str(tokenizer), seq_len=64, global_batch_size=1)


def test_chat_data_needs_a_template_a_known_format_and_examples_that_fit(tmp_path, tokenizer):
    data = chat_file(tmp_path / "chat.jsonl", 40, max_words=100)
    bare = chat_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        ChatDataModule(str(data), str(bare), seq_len=64, global_batch_size=1)
    (tmp_path / "chat.txt").write_text("hello")
    with pytest.raises(ValueError, match="the format must be .jsonl, .json or .parquet, not '.txt'"):
        ChatDataModule(str(tmp_path / "chat.txt"), str(tokenizer), seq_len=64, global_batch_size=1)
    with pytest.raises(ValueError, match=r"\d+ of the 40 examples .* are longer than seq_len\+1=65 tokens"):
        ChatDataModule(str(data), str(tokenizer), seq_len=64, global_batch_size=1)
    with pytest.warns(UserWarning, match=r"of the 40 examples .* dropped"):
        dropped = ChatDataModule(str(data), str(tokenizer), seq_len=64, global_batch_size=1, overlong="drop")
    with pytest.warns(UserWarning, match="cut to 65 tokens"):
        cut = ChatDataModule(str(data), str(tokenizer), seq_len=64, global_batch_size=1, overlong="truncate")
    assert dropped.train_set.loss_mask.sum() < cut.train_set.loss_mask.sum()


def _first_global_batch(data: ChatDataModule, replicas: int) -> list[dict]:
    """Each replica's share of the first global batch (one micro-batch each)."""
    shares = []
    for rank in range(replicas):
        data.data_parallel = (replicas, rank)
        shares.append(next(iter(data.train_dataloader())))
    return shares


def test_the_loss_is_the_mean_over_the_global_batchs_answer_tokens_not_a_mean_of_means(tokenizer, tmp_path):
    data = ChatDataModule(str(chat_file(tmp_path / "c.jsonl", 60, max_words=200)), str(tokenizer), seq_len=256,
                          global_batch_size=4, val_fraction=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CHAT_GPT, init_std=0.5))  # varied per-token losses, as after training
    model.configure_model()
    shares = _first_global_batch(data, replicas=2)
    per_token = []
    for share in shares:
        inputs, targets = model.inputs_and_targets(share)
        logits = model.model(inputs, context=BatchContext(documents.Documents.of(share["positions"][:, :-1])))
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED,
                                                   reduction="none")  # fmt: skip
        per_token.append(losses[targets.flatten() != IGNORED])
    with torch.no_grad():
        global_mean = torch.cat(per_token).mean()
        mean_of_means = torch.stack([t.mean() for t in per_token]).mean()
        replicas_mean = torch.stack([model.loss(share) for share in shares]).mean()  # what DP2 averages
    counts = [len(t) for t in per_token]
    assert counts[0] != counts[1]
    assert abs(replicas_mean - global_mean) < 1e-6
    assert abs(mean_of_means - global_mean) > 1e-3, (mean_of_means, global_mean, counts)


@pytest.mark.parametrize("layout", [name for name in PACKED_LAYOUTS if name.startswith("chat")])
def test_chat_layouts_train_like_one_process(layout, layout_runs, reference_chat_run):
    run, reference = layout_runs[layout], reference_chat_run
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(run["val_loss"], reference["val_loss"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", [name for name in PACKED_LAYOUTS if name.startswith("documents")])
def test_document_masked_layouts_train_like_one_process(layout, layout_runs, reference_documents_run):
    run, reference = layout_runs[layout], reference_documents_run
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=0, atol=1e-5)


def test_a_packed_row_gives_each_document_the_losses_it_has_alone():
    config = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model = GPT(config)
    model.configure_model()
    lengths = [5, 17, 1, 30, 11]
    tokens = torch.randint(0, 64, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model.model(tokens[None], context=BatchContext(documents.Documents.of(positions[None])))[0]
        alone = torch.cat([model.model(part[None])[0] for part in tokens.split(lengths)])
        whole = model.model(tokens[None])[0]
    assert (packed - alone).abs().max() < 1e-5
    assert (whole - alone).abs().max() > 1e-2  # without the mask the documents would see each other


def test_every_layer_keeps_one_shared_mask_for_backward_and_attends_as_with_the_boolean_one():
    """SDPA makes an additive bias of a boolean mask at every call, and each layer's backward kept its own
    ``[batch, 1, seq, seq]`` copy; the documents' bias is made once per forward and every layer saves that one."""
    from lit3d.models.attention import causal_attention

    config = GPTConfig(n_layer=3, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model = GPT(config)
    model.configure_model()
    positions = torch.cat([torch.arange(n) for n in (20, 44)])[None]
    packed = documents.Documents.of(positions)
    square = []  # the saved tensors shaped as a mask, each storage once

    def pack(tensor):
        if tensor.dim() == 4 and tensor.shape[-2:] == (64, 64) and tensor.untyped_storage() not in square:
            square.append(tensor.untyped_storage())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(torch.randint(0, 64, (1, 64)), context=BatchContext(packed))
    assert len(square) == 1 and square[0].nbytes() == 64 * 64 * 4
    q, k, v = (torch.randn(1, 64, 4, 8) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, dim=2).transpose(1, 2),
        v.repeat_interleave(2, dim=2).transpose(1, 2),
        attn_mask=packed.causal_mask,
    ).transpose(1, 2)
    assert torch.equal(causal_attention(q, k, v, documents=packed), expected)


def test_document_masking_packs_positions_that_restart_at_each_document(tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": "x" * n}) for n in [3, 50, 7, 20] * 30))
    data = TextDataModule(str(tmp_path / "docs.jsonl"), seq_len=15, global_batch_size=2, document_masking=True)
    data.setup("fit")
    rows = [data.train_set[i]["positions"].tolist() for i in range(len(data.train_set))]
    whole_documents = []
    for positions in rows:
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        assert starts[0] == 0  # a row's first tokens count as a document of their own
        assert all(p == positions[i - 1] + 1 for i, p in enumerate(positions) if i and p)
        whole_documents += [b - a for a, b in zip(starts[1:-1], starts[2:-1])]  # begun and ended in the row
    assert whole_documents and set(whole_documents) <= {3, 7, 20}
    with pytest.raises(ValueError, match="document_masking=True packs one source's documents"):
        TextDataModule({str(tmp_path / "docs.jsonl"): 1.0, str(tmp_path / "docs.jsonl") + "x": 1.0},
                       document_masking=True)  # fmt: skip


def test_the_mfu_counts_the_attention_of_each_tokens_own_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])  # documents of 3, 2 and 5 tokens
    assert documents.attended_length(positions) == pytest.approx((3 * 3 + 2 * 2 + 5 * 5) / 10)
    assert documents.attended_length(torch.arange(10)[None]) == 10


def test_configs_chat_yaml_tunes_a_huggingface_folder_on_chat_data_and_exports_the_adapter(tmp_path):
    """What a newcomer runs: `configs/chat.yaml` on a local model folder with a chat template, then the export."""
    from test_way_in import ROOT, lit3d

    model = chat_tokenizer(tiny_llama(tmp_path / "model", vocab_size=320))  # a model folder with its tokenizer
    data = chat_file(tmp_path / "chats.jsonl", 40, max_words=12)
    run = lit3d("fit", "--config", str(ROOT / "configs" / "chat.yaml"), f"--model.pretrained={model}",
                f"--data.init_args.tokenizer={model}", f"--data.init_args.data_path={data}",
                "--data.init_args.seq_len=64", "--data.init_args.global_batch_size=2",
                "--data.init_args.val_fraction=0.2", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                "--trainer.callbacks.every_n_train_steps=2", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    losses = logged(tmp_path / "runs" / "chat" / "version_0", "train_loss")
    assert len(losses) == 2 and all(np.isfinite(losses))
    ckpt = tmp_path / "runs" / "chat" / "checkpoints" / "last.ckpt"  # the config's fixed folder
    export = lit3d("export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter"), "--adapter", cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 16


def test_templates_with_huggingfaces_generation_marks_render_as_without(tmp_path):
    marked = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTemplate(chat_tokenizer(tmp_path / "marked", template=marked))
    ids, answer = chat.encode([{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}])
    assert chat.tokenizer.decode(ids[answer].tolist(), skip_special_tokens=False) == "yes<|im_end|>"


def test_an_evaluation_round_weighs_by_its_answer_tokens_and_one_without_any_not_at_all():
    from lit3d.models.documents import document_starts
    from lit3d.models.loss import trained_share

    scales = torch.tensor([4.0, 0.0])  # a round with a quarter of its targets trained; one with none
    assert [float(trained_share({"loss_scale": s[None]})) for s in scales] == [0.25, 0.0]
    assert trained_share({"input_ids": torch.zeros(1, 3)}) == 1.0
    assert document_starts([3, 0, 2, 0]).tolist() == [True, False, False, True, False]  # empty documents start nowhere
