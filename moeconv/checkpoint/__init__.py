"""Reading and writing safetensors checkpoints: headers, index, the streaming writer, the manifest."""

from moeconv.checkpoint.reader import Checkpoint, TensorEntry, TensorReader, open_checkpoint
from moeconv.checkpoint.writer import ShardWriter

__all__ = ["Checkpoint", "ShardWriter", "TensorEntry", "TensorReader", "open_checkpoint"]
