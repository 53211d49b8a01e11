"""Generation: sampling one token from logits (sampling.py) and decoding with
a KV cache (kv_cache.py)."""
from .kv_cache import Decoder, KVCache, generate, stream
from .sampling import sample_next

__all__ = ["Decoder", "KVCache", "generate", "stream", "sample_next"]
