"""lit3d: 3D-parallel (data x tensor x pipeline) training of Llama-style GPTs with PyTorch Lightning."""

from lit3d.config import GPTConfig
from lit3d.gpt import GPT
from lit3d.strategies import Parallel3DStrategy

__all__ = ["GPT", "GPTConfig", "Parallel3DStrategy"]
__version__ = "0.1.0"
