"""KV memory: slot pools, the page allocator, and the prefix (radix) cache."""
