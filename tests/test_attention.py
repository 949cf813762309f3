import pytest
import torch

from lit3d.models.attention import causal_attention, reference_attention, resolve_backend


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_matches_the_textbook_formula(n_head, n_kv_head):
    torch.manual_seed(0)
    q = torch.randn(2, 9, n_head, 16)
    k, v = torch.randn(2, 9, n_kv_head, 16), torch.randn(2, 9, n_kv_head, 16)
    out = causal_attention(q, k, v, backend="sdpa")
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_attention_is_causal():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    changed_future = v.clone()
    changed_future[:, 5:] += 1.0
    before = causal_attention(q, k, v, "sdpa")[:, :5]
    after = causal_attention(q, k, changed_future, "sdpa")[:, :5]
    torch.testing.assert_close(before, after)


def test_auto_picks_sdpa_on_cpu_and_flash_is_refused_where_it_cannot_run():
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    with pytest.raises(RuntimeError, match="flash"):
        resolve_backend("flash", torch.device("cpu"), torch.float32)


@pytest.mark.gpu
def test_flash_attn_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    q = torch.randn(2, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert resolve_backend("auto", q.device, q.dtype) == "flash"
    torch.testing.assert_close(
        causal_attention(q, k, v, "flash"), causal_attention(q, k, v, "sdpa"), rtol=2e-2, atol=2e-2
    )
