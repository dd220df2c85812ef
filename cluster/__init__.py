"""Control plane: OpenAI-compatible ingress, routing, Ray-managed prefill and decode pools, metrics."""
