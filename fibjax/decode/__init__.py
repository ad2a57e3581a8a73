"""fibjax.decode: cached generation (prefill, then one token a step) and sampling.

>>> from fibjax.decode import Decoder, Sampler
>>> decoder = Decoder(model, max_len=2048)
>>> tokens = list(decoder.generate(prompt_BP, 64, sampler=Sampler(temperature=0.8, top_k=50), seed=0))
"""

from fibjax.decode.cache import KV, LayerPlan, cache_bytes, plan_layers
from fibjax.decode.decoder import Decoder
from fibjax.decode.sampling import GREEDY, Sampler, top_k_mask, top_p_mask
from fibjax.decode.stream import TextStreamer

__all__ = ["GREEDY", "KV", "Decoder", "LayerPlan", "Sampler", "TextStreamer", "cache_bytes", "plan_layers", "top_k_mask", "top_p_mask"]
