"""Continuous-batching runtime behind `Engine.generate()`."""
from nfjax.engine.engine import Engine
from nfjax.engine.outputs import RequestOutput, TokenLogprob
from nfjax.engine.sampling_params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "TokenLogprob"]
