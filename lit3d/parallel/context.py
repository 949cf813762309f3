"""Context parallelism's arithmetic: the sequence split each CP rank holds (two of ``2 x cp`` equal chunks, an early
and a late one, for balanced causal attention: `lit3d.models.ring_attention`) and the bytes its ring sends."""

from __future__ import annotations


def check_context_parallel(cp: int, seq_len: int | None, tp: int = 1, sp: bool = False) -> None:
    """Refuse what context parallelism cannot run, naming the values: sequences that do not split into ``2·cp`` equal
    chunks (and, under sequence parallelism, a rank's share that does not split over TP). Windows, sinks and scores
    scaled apart from the head width (gpt-oss, Gemma 3) run in the ring (`lit3d.models.ring_attention`)."""
    if cp == 1:
        return
    if seq_len is None:
        return
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2 x context_parallel_size={2 * cp}: each CP rank holds two "
            "equal chunks of every sequence (an early and a late one, for balanced causal attention)"
        )
    if sp and (seq_len // cp) % tp:
        raise ValueError(
            f"sequence_parallel splits each CP rank's {seq_len // cp} tokens (seq_len={seq_len} / "
            f"context_parallel_size={cp}) over tensor_parallel_size={tp}, which does not divide them"
        )


def ring_bytes_per_layer(kv_elements: float, dtype_bytes: int, cp: int, recomputed: bool = False) -> float:
    """Bytes one rank sends over the CP ring per attention layer and micro-batch: forward's ``cp − 1`` K/V hops
    (twice with a recompute of forward in backward), then backward's ``cp − 1`` K/V hops and ``cp`` hops of the
    K/V gradient, which travels in fp32. ``kv_elements``: the rank's K and V together (its tokens, its K/V heads)."""
    if cp == 1:
        return 0.0
    hops = (cp - 1) * kv_elements * dtype_bytes
    return hops * (2 if recomputed else 1) + hops + cp * kv_elements * 4
