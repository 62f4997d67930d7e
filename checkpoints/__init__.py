"""checkpoints: the training checkpoint's format (training.py) and every source a user may name (sources.py).

Below trainer/ and evaluation/, above models/: both accept run directories and training checkpoints
through here without importing each other, and models/ stays free of the trainer's format.
"""

from checkpoints.sources import SOURCE_FORMATS, convert_checkpoint, detect_format, read_checkpoint

__all__ = ["SOURCE_FORMATS", "convert_checkpoint", "detect_format", "read_checkpoint"]
