"""The KV connector: the messages, stats and lmdb reads its scheduler and worker sides share."""
