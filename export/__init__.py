"""Export of trained policies: ONNX (any runtime) and dependency-free C (microcontrollers)."""
