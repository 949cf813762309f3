"""`lit3d.GPT`'s choice of optimizer as plain values (no torch: the planner reads them): AdamW or Muon, Muon's
settings, and which parameters Muon steps (`is_hidden_matrix`). `lit3d.models.optimizers` builds the optimizer."""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adamw", "muon")
NS_DTYPES = ("auto", "bfloat16", "float32")  # auto: bf16 on a GPU, fp32 on a CPU (see `Muon`)
RMS_RULES = ("match_rms_adamw", "original")  # `lit3d.models.muon.rms_scale`


@dataclass(frozen=True)
class MuonSettings:
    """Muon's settings (`lit3d.GPT`'s ``muon_*`` arguments): its momentum, Newton–Schulz steps and their dtype, and the
    rule that scales each matrix's update (``match_rms_adamw``: to AdamW's RMS, so ``learning_rate`` and
    ``weight_decay`` carry over from AdamW; ``original``: Keller Jordan's ``√max(1, rows / cols)``); ``qk_clip``: the
    threshold of QK-clip (MuonClip, `lit3d.models.qk_clip`), None for none."""

    momentum: float = 0.95
    ns_steps: int = 5
    ns_dtype: str = "auto"
    rms_rule: str = "match_rms_adamw"
    qk_clip: float | None = None

    def refusal(self) -> str | None:
        wrong = [
            f"muon_momentum={self.momentum} must lie in [0, 1)" if not 0 <= self.momentum < 1 else "",
            f"muon_ns_steps={self.ns_steps} must be a positive integer" if self.ns_steps < 1 else "",
            f"muon_ns_dtype={self.ns_dtype!r} is not one of {', '.join(NS_DTYPES)}"
            if self.ns_dtype not in NS_DTYPES
            else "",
            f"muon_rms_rule={self.rms_rule!r} is not one of {', '.join(RMS_RULES)}"
            if self.rms_rule not in RMS_RULES
            else "",
            f"muon_qk_clip={self.qk_clip} must be a positive threshold (Kimi K2 trained with 100) or None"
            if self.qk_clip is not None and not self.qk_clip > 0
            else "",
        ]
        wrong = [w for w in wrong if w]
        return "; ".join(wrong) if wrong else None


def choice_refusal(impl: str, kind: str, muon: MuonSettings, adapters: bool) -> str | None:
    """What is wrong with `lit3d.GPT`'s choice of optimizer, in one line (None when nothing is)."""
    if impl not in ("auto", "foreach", "fused") or kind not in OPTIMIZERS:
        return (
            f"optimizer_impl={impl!r}, optimizer={kind!r}: one of 'auto', 'foreach', 'fused', and one of "
            f"{', '.join(map(repr, OPTIMIZERS))}"
        )
    if kind == "muon" and adapters:
        return (
            "optimizer='muon' with LoRA adapters: their low-rank factors are not the hidden matrices Muon "
            "orthogonalises; train them with optimizer='adamw'"
        )
    if kind != "muon" and muon.qk_clip is not None:
        return f"muon_qk_clip={muon.qk_clip} with optimizer={kind!r}: QK-clip is MuonClip's, use optimizer='muon'"
    return muon.refusal() if kind == "muon" else None


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """A parameter Muon steps: a block's (or a multi-token-prediction depth's) projection matrix, or a stack of
    experts' (each expert its own matrix). Not the embedding, the head, the norms, the biases, the sinks, or a
    router's gate (a classifier over the experts, kept on AdamW as Moonlight keeps its router)."""
    inside = ".blocks." in f".{name}" or name.startswith(("mtp.", "model.mtp."))
    matrix = name.endswith("_proj.weight") or (name.endswith("_proj") and ".experts." in name)
    return inside and matrix and ndim >= 2
