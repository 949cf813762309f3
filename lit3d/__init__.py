"""lit3d: 3D-parallel (data x tensor x pipeline) training of Llama-style GPTs with PyTorch Lightning."""

from lit3d.config import GPTConfig
from lit3d.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
__version__ = "0.1.0"
