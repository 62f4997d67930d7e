"""The LLaMA-style model family: config presets, the model, its loss, checkpoints and conversion."""

from models.attention import LocalAttention
from models.checkpoint import load_model, save_model
from models.config import PRESETS, ModelConfig, RopeScaling
from models.convert import convert_checkpoint
from models.llama import Transformer, init_model
from models.loss import chunked_cross_entropy, token_losses

__all__ = [
    "PRESETS",
    "LocalAttention",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "chunked_cross_entropy",
    "convert_checkpoint",
    "init_model",
    "load_model",
    "save_model",
    "token_losses",
]
