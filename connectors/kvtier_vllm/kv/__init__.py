"""The KV connector: the pool layout, and the messages, stats and lmdb reads its scheduler and
worker sides share."""
