"""ELMo contextual embeddings: char-CNN + biLSTM language model, ONNX runtime, gRPC service."""

__version__ = "0.1.0"
