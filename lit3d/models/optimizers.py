"""The optimizer `lit3d.GPT` trains with: AdamW, or Muon on the hidden matrices and AdamW on the rest
(`lit3d.models.muon`), in their parameter groups (the choice and its settings: `lit3d.models.optimizer_settings`)."""

from __future__ import annotations

from typing import Any

import torch

from lit3d.models.muon import Muon
from lit3d.models.optimizer_settings import MuonSettings, is_hidden_matrix


def build_optimizer(
    named: list[tuple[str, torch.nn.Parameter]],
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    impl: str,
    muon: MuonSettings,
) -> torch.optim.Optimizer:
    """The optimizer of the trainable ``named`` parameters: weight decay on matrices only (not on norms, biases,
    sinks); with ``kind="muon"``, Muon on `is_hidden_matrix` ones and AdamW on the rest, in one optimizer."""
    params = [(n, p) for n, p in named if p.requires_grad]
    if kind == "adamw":
        groups = [
            {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        options: dict[str, Any] = {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **options)
    hidden = [p for n, p in params if is_hidden_matrix(n, p.ndim)]
    chosen = {id(p) for p in hidden}
    rest = [p for _, p in params if id(p) not in chosen]
    groups = [
        {"params": hidden, "muon": True, "weight_decay": weight_decay},
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    names = {id(p): n for n, p in params}
    return Muon(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        momentum=muon.momentum,
        ns_steps=muon.ns_steps,
        ns_dtype=None if muon.ns_dtype == "auto" else getattr(torch, muon.ns_dtype),  # (one of `NS_DTYPES`)
        rms_rule=muon.rms_rule,
        names=[names[id(p)] for group in groups for p in group["params"]],
    )
