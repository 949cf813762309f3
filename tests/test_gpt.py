import math

import lightning as L
import pytest
import torch
from helpers import fit, logged

from lit3d import GPT, GPTConfig
from lit3d.data import TextDataModule
from lit3d.models.generation import Sampling, next_token
from lit3d.models.gpt import WarmupCosine


def test_weight_decay_applies_to_matrices_only(small_config):
    model = GPT(small_config, weight_decay=0.3)
    model.configure_model()
    model.trainer = L.Trainer(max_steps=10, logger=False)
    optimizer = model.configure_optimizers()["optimizer"]
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.3 and all(p.ndim == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    schedule = WarmupCosine(warmup_steps=10, decay_steps=110, min_ratio=0.1)
    assert [round(schedule(s), 3) for s in (0, 4, 9)] == [round(1 / 11, 3), round(5 / 11, 3), round(10 / 11, 3)]
    assert schedule(10) == 1.0
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)


def test_generate_appends_tokens_and_greedy_is_deterministic(small_config):
    torch.manual_seed(0)
    model = GPT(small_config)
    prompt = torch.tensor([1, 2, 3])
    greedy = model.generate(prompt, Sampling(5, temperature=0))
    assert greedy.shape == (8,) and torch.equal(greedy[:3], prompt)
    assert torch.equal(greedy, model.generate(prompt, Sampling(5, temperature=0)))
    for top in (dict(top_k=1), dict(top_p=1e-6)):  # sampling among the one most likely token is greedy
        sampled = model.generate(prompt[None].repeat(2, 1), Sampling(4, **top), torch.Generator().manual_seed(0))
        assert torch.equal(sampled[0], greedy[:7]) and torch.equal(sampled[1], greedy[:7])


def test_top_p_keeps_the_smallest_set_of_likely_tokens_reaching_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, -10.0]]).log_softmax(-1)  # probabilities ~0.66, 0.24, 0.09, 0
    draws = {next_token(logits, Sampling(top_p=0.8, temperature=1), torch.Generator().manual_seed(s)).item()
             for s in range(200)}  # fmt: skip
    assert draws == {0, 1}  # 0.66 < 0.8: the second is needed; the third is not
    with pytest.raises(ValueError, match="top_p=1.5 must lie in"):
        Sampling(top_p=1.5)


def test_a_python_api_run_logs_throughput_without_being_asked(small_config, text_folder, tmp_path):
    data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=2)
    trainer, log_dir = fit(GPT(small_config), data, tmp_path, max_steps=5)  # no callbacks given
    assert len(logged(log_dir, "perf/tokens_per_s")) == 3  # after Throughput's default warm-up of 2 steps


def test_loss_decreases_on_the_demo_corpus(tmp_path):
    L.seed_everything(0)
    model = GPT("tiny", learning_rate=3e-3, warmup_steps=5)
    data = TextDataModule(seq_len=64, global_batch_size=8)
    _, log_dir = fit(model, data, tmp_path, max_steps=50)
    losses = logged(log_dir, "train_loss")
    assert len(losses) == 50
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # a uniform guess over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0


def test_accumulation_logs_the_global_batch_mean_and_matches_one_big_batch(tmp_path, text_folder):
    def run(accumulate):
        L.seed_everything(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32), learning_rate=1e-2, warmup_steps=0)
        data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=8)
        _, log_dir = fit(model, data, tmp_path / f"acc{accumulate}", max_steps=3, accumulate_grad_batches=accumulate)
        return logged(log_dir, "train_loss"), model.state_dict()

    (losses_1, weights_1), (losses_4, weights_4) = run(1), run(4)
    assert len(losses_4) == 3  # once per optimizer step, not per micro-batch
    torch.testing.assert_close(torch.tensor(losses_4), torch.tensor(losses_1), rtol=1e-5, atol=0)
    for key in weights_1:
        torch.testing.assert_close(weights_4[key], weights_1[key], rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_stops_training_naming_the_step(tmp_path, text_folder):
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32))
    model.configure_model()
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    data = TextDataModule(str(text_folder), seq_len=16, global_batch_size=4)
    with pytest.raises(FloatingPointError, match="train_loss is nan at step 0"):
        fit(model, data, tmp_path)


def test_model_and_data_must_agree(tmp_path, text_folder):
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, max_seq_len=16))
    with pytest.raises(ValueError, match="seq_len=32 is above the model's max_seq_len=16"):
        fit(model, TextDataModule(str(text_folder), seq_len=32, global_batch_size=2), tmp_path)
    small_vocab = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=100))
    with pytest.raises(ValueError, match="the tokenizer has 256 ids but the model's vocab_size=100"):
        fit(small_vocab, TextDataModule(str(text_folder), seq_len=8, global_batch_size=2), tmp_path)


def test_bad_optimizer_and_schedule_arguments_are_refused_when_the_model_is_built_in_one_line():
    """Each bad value is named, all of them in one message, before ``torch.optim`` (or any rank) sees them."""
    with pytest.raises(ValueError) as refused:
        GPT("tiny", learning_rate=-1e-3, weight_decay=-0.1, betas=(0.9, 1.5), eps=-1.0, warmup_steps=10, decay_steps=5)
    message = str(refused.value)
    assert "\n" not in message
    for named in ("learning_rate=-0.001", "weight_decay=-0.1", "betas=(0.9, 1.5)", "eps=-1.0", "decay_steps=5"):
        assert named in message, message
    with pytest.raises(ValueError, match=r"min_lr_ratio=2 must lie in \[0, 1\]"):
        GPT("tiny", min_lr_ratio=2)
    GPT("tiny", learning_rate=1e-3, warmup_steps=0, decay_steps=1)  # the edges that are fine


def test_a_run_shorter_than_its_warm_up_is_told_so():
    from lit3d.models.lr_schedule import horizon_warning

    said = horizon_warning(warmup_steps=30, decay_steps=None, max_steps=10)
    assert "max_steps=10 ends within warmup_steps=30" in said
    assert horizon_warning(30, None, 40) is None and horizon_warning(30, 60, 10) is None
    assert horizon_warning(30, None, -1) is None  # no max_steps: an epoch-bound run


def test_a_changed_learning_rate_is_said_in_digits_that_tell_the_two_apart():
    from lit3d.models.lr_schedule import differing

    assert differing(0.0025213, 0.0025198) == "0.002521, not 0.00252"  # 0.00252 both, at 3 digits
    assert differing(0.001, 0.002) == "0.001, not 0.002"
    assert differing(0.001, 0.001) == "0.001 (unchanged)"
