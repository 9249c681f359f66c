"""nfjax: a throughput-first LLM serving engine on JAX/XLA."""
