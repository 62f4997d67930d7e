"""The trainer: `train(config)` runs one rank; `launch(config)` starts the ranks (what `burst train` calls)."""

from trainer.config import TrainConfig, load_config
from trainer.launch import launch
from trainer.parallelize import parallelize
from trainer.train import TrainingStopped, train

__all__ = ["TrainConfig", "TrainingStopped", "launch", "load_config", "parallelize", "train"]
