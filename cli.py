"""lit3d's command line: ``lit3d fit|validate|test|predict --config ...`` (LightningCLI), ``lit3d plan``, ``lit3d export``.

``python cli.py ...`` does the same as the installed ``lit3d`` console script.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

import strategies  # noqa: F401  (registers "3d" and makes `Parallel3DStrategy` resolvable by its short name)
from lit3d.gpt import GPT, check_model_fits_data


class Lit3DCLI(LightningCLI):
    """LightningCLI with lit3d's defaults: the tiny GPT on the embedded corpus, a Rich progress bar when interactive."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.set_defaults({
            "model": {"class_path": "lit3d.GPT"},
            "data": {"class_path": "lit3d.data.TextDataModule"},
        })

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        given = list(config.get("callbacks") or []) + callbacks
        if sys.stdout.isatty() and config.get("enable_progress_bar") is not False \
                and not any(isinstance(c, ProgressBar) for c in given):
            callbacks = [*callbacks, RichProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _check_model_and_data(self) -> None:
        # Before the trainer launches any process: a mismatch fails here, once, with a clear message.
        if isinstance(self.model, GPT) and self.datamodule is not None:
            check_model_fits_data(self.model.config, self.datamodule)

    before_fit = before_validate = before_test = before_predict = _check_model_and_data


def export(ckpt_path: str, output: str, dtype: str = "float32") -> None:
    """Write a lit3d checkpoint (saved by any layout) as a HuggingFace Llama folder.

    Args:
        ckpt_path: The checkpoint folder (e.g. ``runs/tiny/version_0/checkpoints/epoch=0-step=600.ckpt``).
        output: The folder to write: ``config.json`` and ``model.safetensors`` (and ``tokenizer.json`` when the
            run used one), loadable with ``transformers.AutoModelForCausalLM.from_pretrained(output)``.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """
    import torch

    from lit3d.hf import export_checkpoint

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    folder = export_checkpoint(ckpt_path, output, getattr(torch, dtype))
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        from jsonargparse import CLI

        CLI(export, args=argv[1:], as_positional=False)
        return
    Lit3DCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
