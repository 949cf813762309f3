"""The rotary scalings lit3d computes (`lit3d.models.rotary`): their names and parameters, plain values that
`lit3d.GPTConfig` checks and the HuggingFace import reads (no torch)."""

from __future__ import annotations

from typing import Any

# Rotary scalings lit3d computes (`lit3d.models.rotary`), and the parameters each needs besides ``rope_type``.
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# The parameters a scaling may have besides those it needs (HuggingFace's defaults when absent).
ROPE_OPTIONS = {"yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")}


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """Refuse a rotary scaling lit3d does not compute, or one missing a parameter, naming it."""
    if not scaling:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={scaling}: rope_type {kind!r} is not one of {', '.join(ROPE_SCALINGS)}")
    missing = [name for name in ROPE_SCALINGS[kind] if name not in scaling]
    if missing:
        raise ValueError(f"rope_scaling={scaling}: {kind} needs {', '.join(missing)}")
