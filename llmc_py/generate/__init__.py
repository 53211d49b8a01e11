"""Generation: sampling one token from logits and decoding with a KV cache.
The code lives beside the model (model.sampling, model.kv_cache), whose
generate() runs it, as nanoGPT's model holds its generate and sampling."""
from ..model.kv_cache import Decoder, KVCache, generate, stream
from ..model.sampling import sample_next

__all__ = ["Decoder", "KVCache", "generate", "stream", "sample_next"]
