"""The inference engine: continuous batching over a preallocated per-slot KV store."""
