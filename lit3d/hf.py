"""HuggingFace Llama, Mistral, Qwen3 and Mixtral folders in and out: ``config.json`` + safetensors, local folders
only (no hub).

The layouts match one to one (lit3d uses HuggingFace's rotate-half rotary convention), so weights are renamed,
never permuted; lit3d's vocabulary padding rows are added on import and dropped on export. Mixtral's experts are
read from the per-expert ``w1``/``w2``/``w3`` matrices of its published checkpoints (or transformers 5's stacked
``gate_up_proj``/``down_proj``) into lit3d's stacked ``[expert, in, out]`` weights, and written back per expert.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from lit3d.adapters import merge_adapters, write_adapter
from lit3d.config import ROPE_SCALINGS, GPTConfig
from lit3d.lora import LoRA

# lit3d name (relative to the Transformer) -> HuggingFace name; {i} is the block index.
NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # Qwen3
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


# lit3d MoE name -> Mixtral name ({e}: the expert); the lit3d tensors stack the experts and are transposed.
MIXTRAL_NAMES = {
    "blocks.{i}.mlp.router.gate.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "blocks.{i}.mlp.experts.gate_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "blocks.{i}.mlp.experts.down_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    "blocks.{i}.mlp.experts.up_proj": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
}


def hf_name(name: str) -> str:
    """lit3d → HuggingFace parameter name."""
    block = re.match(r"blocks\.(\d+)\.", name)
    pattern = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", name)
    names = {**NAMES, **MIXTRAL_NAMES}
    if pattern not in names:
        raise KeyError(f"no HuggingFace name for lit3d parameter {name!r}")
    return names[pattern].format(i=block.group(1) if block else "", e="{e}")


# The HuggingFace families lit3d imports and exports: model_type -> architecture.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM"}  # fmt: skip


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """A `GPTConfig` from a Llama, Mistral, Qwen3 or Mixtral ``config.json``; refuses what lit3d's model does not
    compute, naming the field."""
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r}: lit3d imports {', '.join(FAMILIES)} folders")
    if hf.get("sliding_window") and (model_type != "qwen3" or hf.get("use_sliding_window")):
        raise ValueError(f"sliding_window={hf['sliding_window']} is not supported (lit3d attends to the whole context)")
    rope = hf.get("rope_parameters") or {}
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{flag}=True is not supported (lit3d's linears have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (lit3d's MLP is SwiGLU with SiLU)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return GPTConfig(
        name=hf.get("_name_or_path") or "hf",
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=head_dim if head_dim * heads != hf["hidden_size"] else None,
        qk_norm=model_type == "qwen3",
        family=model_type,
        **(_moe_from_hf(hf) if model_type == "mixtral" else {}),
    )


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The rotary scaling of a ``config.json`` (``rope_scaling``, or transformers 5's ``rope_parameters``) as
    `GPTConfig.rope_scaling`: its type and the parameters that type reads; None for plain rotary embeddings. A type
    lit3d does not compute is refused by `GPTConfig`, naming it."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {"rope_type": kind, **{k: scaling[k] for k in ROPE_SCALINGS.get(kind, ()) if k in scaling}}


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        n_expert=hf["num_local_experts"],
        n_expert_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["intermediate_size"],
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.02),
    )


def config_to_hf(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A Llama ``config.json``, or a Mixtral one for an MoE model Mixtral can express."""
    moe = {}
    if config.n_expert:
        unlike = {"n_shared_expert": 0, "first_dense_layers": 0, "router": "softmax", "d_ff_expert": config.d_ff}
        different = {k: getattr(config, k) for k, v in unlike.items() if getattr(config, k) != v}
        if different:
            raise ValueError(f"a Mixtral folder cannot hold {different} (Mixtral: {unlike})")
        moe = {
            "num_local_experts": config.n_expert,
            "num_experts_per_tok": config.n_expert_per_token,
            "router_aux_loss_coef": config.aux_loss_coef,
            "output_router_logits": False,
            "sliding_window": None,
        }
    family = "mixtral" if config.n_expert else config.family
    if config.qk_norm != (family == "qwen3"):
        raise ValueError(f"a {family} folder cannot hold qk_norm={config.qk_norm} (Qwen3's per-head q/k norms)")
    return {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "hidden_act": "silu",
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})},
        "rope_scaling": config.rope_scaling,
        "sliding_window": None,
    } | moe


def read_config(folder: str | Path) -> GPTConfig:
    """The `GPTConfig` of a local HuggingFace folder's ``config.json``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a HuggingFace model folder: config.json is missing")
    return config_from_hf(json.loads((folder / "config.json").read_text()))


def read_folder(folder: str | Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(config, HuggingFace-named tensors) of a local folder with ``config.json`` and safetensors files."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(folder)!r} (PyTorch .bin weights are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors


def to_lit3d_names(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HuggingFace-named tensors → lit3d names (relative to the `Transformer`), checked against the model's shapes.

    The vocabulary tensors keep HuggingFace's rows; lit3d's padding rows are added (as zeros) when the weights
    are copied into the model (`Transformer.reset_parameters`).
    """
    from lit3d.model import Transformer

    with torch.device("meta"):
        network = Transformer(config)
    tensors = _stack_experts(config, tensors)
    out, missing, wrong = {}, [], []
    for name, param in network.named_parameters():  # a tied head shares the embedding: not listed again
        key = hf_name(name).replace(".{e}.", ".*.")
        if key not in tensors:
            missing.append(key)
            continue
        value = tensors[key]
        vocabulary = name in ("embed.weight", "head.weight")  # lit3d pads these rows
        expected = (config.vocab_size, *param.shape[1:]) if vocabulary else tuple(param.shape)
        if tuple(value.shape) != expected:
            wrong.append(f"{key}: {tuple(value.shape)}, expected {expected}")
            continue
        out[name] = value
    if missing or wrong:
        raise ValueError(f"the HuggingFace weights do not fit: missing {missing[:5]}, mismatched {wrong[:5]}")
    return out


def _stack_experts(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's experts as lit3d stacks them (``[expert, in, out]``), keyed ``...experts.*.w1.weight`` etc.: from
    the per-expert matrices of published checkpoints, or from transformers 5's ``gate_up_proj``/``down_proj``."""
    if not config.n_expert:
        return tensors
    out = dict(tensors)
    for i in range(config.n_layer):
        layer = f"model.layers.{i}"
        fused = f"{layer}.mlp.experts.gate_up_proj"
        if fused in tensors:  # transformers 5: [expert, 2 f, h] and [expert, h, f], router at mlp.gate.weight
            gate, up = tensors[fused].chunk(2, dim=1)
            parts = {"w1": gate, "w3": up, "w2": tensors[f"{layer}.mlp.experts.down_proj"]}
            out[f"{layer}.block_sparse_moe.gate.weight"] = tensors[f"{layer}.mlp.gate.weight"]
        else:
            parts = {}
            for w in ("w1", "w2", "w3"):
                keys = [f"{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(config.n_expert)]
                if all(k in tensors for k in keys):
                    parts[w] = torch.stack([tensors[k] for k in keys])
        for w, stacked in parts.items():
            out[f"{layer}.block_sparse_moe.experts.*.{w}.weight"] = stacked.transpose(1, 2)
    return out


def write_folder(
    folder: str | Path,
    config: GPTConfig,
    network_state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    token_ids: dict[str, Any] | None = None,
) -> Path:
    """Write a HuggingFace Llama folder from a lit3d `Transformer` state dict (names relative to it); ``token_ids``
    (``bos_token_id``, ``eos_token_id``, ...) go into its ``config.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in network_state.items():
        if name == "head.weight" and config.tie_embeddings:
            continue
        if name in ("embed.weight", "head.weight"):
            value = value[: config.vocab_size]  # drop lit3d's padding rows
        key = hf_name(name)
        if "{e}" in key:  # an MoE expert stack: Mixtral keeps one [out, in] matrix per expert
            for e, matrix in enumerate(value.transpose(1, 2)):
                tensors[key.format(e=e)] = matrix.to(dtype).contiguous()
            continue
        tensors[key] = value.to(dtype).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(config, dtype) | (token_ids or {}), indent=2))
    return folder


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_checkpoint(
    ckpt_path: str | Path, output: str | Path, dtype: torch.dtype = torch.float32, adapter: bool = False
) -> tuple[Path, list[str]]:
    """A lit3d checkpoint of any layout → a HuggingFace Llama folder (one process, no GPU needed), and one line per
    thing generation needs on where it came from (token ids, generation config, tokenizer). A LoRA run's adapters
    are merged into their linears, or with ``adapter`` written alone as a PEFT folder (`lit3d.adapters`).

    The sharded tensors are read whole with `torch.distributed.checkpoint` (`lit3d.pretrained.read_checkpoint`),
    which reassembles the shards of every layout from their recorded global offsets. The BOS/EOS/pad ids and
    ``generation_config.json`` are the HuggingFace folder's the weights started from (`source_folder`); else the
    run's tokenizer's ids. The tokenizer is the run's own (`lit3d.tokenizers.export_tokenizer`).
    """
    import shutil

    from lit3d.pretrained import read_checkpoint
    from lit3d.tokenizers import export_tokenizer

    config, network_state, meta = read_checkpoint(ckpt_path)
    source, notes = source_folder(meta)
    lora = (meta.get("hyper_parameters") or {}).get("lora")
    if adapter:
        base = str(source) if source is not None else None
        if lora is None:
            raise ValueError(f"{str(ckpt_path)!r} was trained without LoRA adapters: export it without --adapter")
        folder = write_adapter(output, network_state, LoRA(**lora), base)
        return folder, [f"LoRA adapters (rank {lora['rank']}, {', '.join(lora['targets'])}) for the base {base!r}"]
    if lora is not None:
        network_state = merge_adapters(network_state, LoRA(**lora))
        notes.append(f"LoRA adapters (rank {lora['rank']}) merged into their linears")
    tokenizer = (meta.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    if tokenizer is None and source is not None and (source / "tokenizer.json").is_file():
        tokenizer = str(source)  # NOTE: a run without a datamodule (plain dataloaders) kept the source's
    if source is not None:
        hf = json.loads((source / "config.json").read_text())
        token_ids = {key: hf[key] for key in TOKEN_IDS if key in hf}
    else:
        token_ids = _tokenizer_ids(tokenizer)
    folder = write_folder(output, config, network_state, dtype, token_ids)
    ids = ", ".join(f"{key}={value}" for key, value in token_ids.items() if value is not None)
    origin = f"{str(source)!r}" if source is not None else f"the tokenizer {tokenizer!r}"
    if ids:
        notes.append(f"token ids: {ids} from {origin}")
    else:  # NOTE: null rather than LlamaConfig's defaults, which would stop generation at the wrong token
        why = "the byte tokenizer has no BOS/EOS" if tokenizer == "byte" else "no source folder or tokenizer names them"
        notes.append(f"token ids: none ({why}; config.json says null, so generation stops at max_new_tokens)")
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", folder / "generation_config.json")
        notes.append(f"generation_config.json: {str(source)!r}'s")
    notes.append(export_tokenizer(tokenizer, folder, config.max_seq_len))
    return folder, notes


def source_folder(meta: dict[str, Any]) -> tuple[Path | None, list[str]]:
    """The HuggingFace folder a checkpoint's weights started from (``GPT(pretrained=...)``, followed back through
    lit3d checkpoints that started from one), and a note when that folder is gone."""
    from lit3d.pretrained import is_hf_folder, read_meta

    pretrained, seen = (meta.get("hyper_parameters") or {}).get("pretrained"), set()
    while pretrained and pretrained not in seen:
        seen.add(pretrained)
        if is_hf_folder(pretrained):
            return Path(pretrained), []
        if not Path(pretrained).exists():
            return None, [f"source: {pretrained!r}, where the weights started, is gone: its token ids are not kept"]
        pretrained = (read_meta(pretrained).get("hyper_parameters") or {}).get("pretrained")
    return None, []


def _tokenizer_ids(tokenizer: str | None) -> dict[str, Any]:
    """BOS/EOS of the run's tokenizer (None where it has none, rather than LlamaConfig's defaults 1 and 2)."""
    from lit3d.tokenizers import load_tokenizer

    try:
        loaded = load_tokenizer(tokenizer) if tokenizer else None
    except (FileNotFoundError, ValueError):
        loaded = None  # NOTE: `export_tokenizer` says so
    return {"bos_token_id": getattr(loaded, "bos_id", None), "eos_token_id": getattr(loaded, "eos_id", None)}
