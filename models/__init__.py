"""The LLaMA-style model family: config presets, the model, its loss, checkpoints and conversion."""

from models.attention import LocalAttention
from models.checkpoint import load_model, save_model
from models.config import PRESETS, ModelConfig
from models.convert import convert_checkpoint
from models.llama import Transformer, init_model
from models.loss import chunked_cross_entropy, token_losses
from models.rope import DynamicRope, LinearRope, Llama3Rope, LongRope, RopeScaling, YarnRope

__all__ = [
    "PRESETS",
    "DynamicRope",
    "LinearRope",
    "Llama3Rope",
    "LocalAttention",
    "LongRope",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "YarnRope",
    "chunked_cross_entropy",
    "convert_checkpoint",
    "init_model",
    "load_model",
    "save_model",
    "token_losses",
]
