"""The K3 model: HF config parsing and presets, layers (thin: project, then call `kernels`),
weight loading (safetensors, MXFP4 packed experts, TP sharding), tiny checkpoint writer, tokenizer."""
