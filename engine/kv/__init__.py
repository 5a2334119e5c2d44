"""The KV core: blocks, sequences, tiers and their arenas, codecs, the prefix cache; `PagedKVCache` is its facade."""
