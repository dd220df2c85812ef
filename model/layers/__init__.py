"""K3 layers. Thin by design: they project, pick the op (prefill or decode form), and call `kernels`."""
