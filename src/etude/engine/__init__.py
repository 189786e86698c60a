"""etude.engine: batched generation with a KV cache, returning token ids and logprobs."""

from etude.engine.engine import Engine
from etude.engine.sampling import Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams"]
