"""The LLaMA-style model family: config presets, the model, its loss, checkpoints and conversion."""

from models.attention import LocalAttention
from models.checkpoint import load_model, save_model
from models.config import PRESETS, ModelConfig, RopeScaling
from models.convert import convert_checkpoint
from models.llama import Transformer
from models.loss import chunked_cross_entropy

__all__ = [
    "PRESETS",
    "LocalAttention",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "chunked_cross_entropy",
    "convert_checkpoint",
    "load_model",
    "save_model",
]
