"""LoRA adapters in and out as PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``), and merged
into the base weights for a plain HuggingFace export.

PEFT names an adapter of a Llama's ``model.layers.{i}.self_attn.q_proj`` ``base_model.model.model.layers.{i}.
self_attn.q_proj.lora_A.weight`` (``lora_B``), with lit3d's shapes: A ``(rank, in)``, B ``(out, rank)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from lit3d.models.config import GPTConfig
from lit3d.models.lora import ADAPTERS, ROLES, LoRA
from lit3d.outputs import MARK

PEFT_PREFIX = "base_model.model.model.layers"
_OURS = re.compile(r"blocks\.(\d+)\.(attn|mlp)\.(\w+)\.lora_(a|b)$")
_THEIRS = re.compile(re.escape(PEFT_PREFIX) + r"\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def merge_adapters(state: dict[str, torch.Tensor], lora: LoRA) -> dict[str, torch.Tensor]:
    """``state`` (lit3d names) with each adapter folded into its linear: ``W + (alpha / rank) · B A``; an MoE
    layer's experts (``[expert, in, out]``) each get their own: ``W_e + (alpha / rank) · A_e B_e``."""
    merged = {name: tensor for name, tensor in state.items() if not name.endswith(ADAPTERS)}
    for name in state:
        if name.endswith(".lora_a"):
            module = name.removesuffix(".lora_a")
            a, b = state[name].float(), state[f"{module}.lora_b"].float()
            weight = merged[f"{module}.weight"]
            merged[f"{module}.weight"] = (weight.float() + lora.scaling * b @ a).to(weight.dtype)
        elif name.endswith("_lora_a"):  # an MoE layer's experts
            weight_name = name.removesuffix("_lora_a")
            a, b, weight = state[name].float(), state[f"{weight_name}_lora_b"].float(), merged[weight_name]
            merged[weight_name] = (weight.float() + lora.scaling * torch.bmm(a, b)).to(weight.dtype)
    return merged


def peft_config(lora: LoRA, base: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for ``lora`` on the model at ``base`` (None: not known)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(ROLES[t][1].split(".")[-1] for t in lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_adapter(folder: str | Path, state: dict[str, torch.Tensor], lora: LoRA, base: str | None) -> Path:
    """The adapters of ``state`` (lit3d names) as a PEFT folder that ``peft.PeftModel.from_pretrained`` loads."""
    from safetensors.torch import save_file

    experts = [name for name in state if name.endswith("_lora_a")]
    if experts:  # NOTE: transformers 5 fuses a Mixtral layer's gate and up into one parameter, which PEFT adapts
        # with one A for both: lit3d's per-projection adapters have no PEFT form there
        raise ValueError(
            f"the adapters on an MoE model's experts ({experts[0]}, ...) have no PEFT form for "
            "transformers' fused experts: export the merged model (without --adapter)"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in state.items():
        found = _OURS.search(name)
        if found:
            block, kind, module, which = found.groups()
            kind = "self_attn" if kind == "attn" else kind
            tensors[f"{PEFT_PREFIX}.{block}.{kind}.{module}.lora_{which.upper()}.weight"] = tensor.contiguous()
    if not tensors:
        raise ValueError("the checkpoint holds no LoRA adapters to export (trained without --model.lora)")
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt", **MARK})  # `is_export_folder`
    (folder / "adapter_config.json").write_text(json.dumps(peft_config(lora, base), indent=2))
    return folder


def read_adapter(folder: str | Path, n_layer: int) -> tuple[LoRA, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder → its `LoRA` settings and its tensors in lit3d's names; refuses what lit3d cannot
    compute the same way (biases, DoRA, rsLoRA, per-module ranks, modules it does not name)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    problems = [
        f"{key}={config.get(key)!r}"
        for key, ok in (("peft_type", "LORA"), ("bias", "none"), ("use_dora", False), ("use_rslora", False))
        if config.get(key, ok) != ok
    ]
    problems += [f"{key}={config[key]!r}" for key in ("rank_pattern", "alpha_pattern") if config.get(key)]
    names = {ROLES[role][1].split(".")[-1]: role for role in ROLES}
    targets = config.get("target_modules") or []
    unknown = [t for t in targets if t not in names]
    if problems or unknown:
        raise ValueError(
            f"{folder}: a LoRA adapter lit3d does not compute the same way: "
            f"{', '.join(problems + [f'target_modules {unknown}'] * bool(unknown))}"
        )
    lora = LoRA(
        rank=config["r"],
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        targets=tuple(names[t] for t in targets),
    )
    tensors = {}
    for name, tensor in load_file(str(folder / "adapter_model.safetensors")).items():
        found = _THEIRS.search(name.replace(".default.", "."))
        if not found or int(found[1]) >= n_layer:
            raise ValueError(f"{folder}: {name!r} is not a LoRA weight of this model's {n_layer} blocks")
        block, kind, module, which = found.groups()
        kind = "attn" if kind == "self_attn" else kind
        tensors[f"blocks.{block}.{kind}.{module}.lora_{which.lower()}"] = tensor
    return lora, tensors


def adapter_settings(adapter: str, config: GPTConfig, lora: LoRA | None) -> LoRA:
    """The settings of the PEFT folder ``adapter``; refused if ``lora`` is given and differs."""
    found, _ = read_adapter(adapter, config.n_layer)
    if lora is not None and lora != found:
        raise ValueError(f"lora={lora} differs from the adapter {adapter!r}'s settings {found}: give one of them")
    return found
