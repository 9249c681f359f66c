"""nfjax: a throughput-first LLM serving engine on JAX/XLA."""
__all__ = ["Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name):   # lazy: `import nfjax.config` must not pull in the whole engine
    if name in __all__:
        import nfjax.engine as eng
        return getattr(eng, name)
    raise AttributeError(name)
