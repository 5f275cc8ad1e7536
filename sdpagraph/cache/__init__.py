"""Graph cache: compiled graphs in an in-process LRU and a shared on-disk store.

Generic over blobs, except `graph_store`, which keys and builds cuDNN graphs through it
(see docs/cache.md).
"""
from sdpagraph.cache.defaults import default_cache, set_default_cache
from sdpagraph.cache.graph_cache import CacheMissError, GraphCache
from sdpagraph.cache.keys import CacheKey, key_digest

__all__ = ["CacheKey", "CacheMissError", "GraphCache", "default_cache", "key_digest", "set_default_cache"]
