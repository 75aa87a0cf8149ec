"""The inference engine: continuous batching over a paged KV store (rose.engine.block_pool, kv_cache)."""
