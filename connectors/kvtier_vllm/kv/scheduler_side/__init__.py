"""The KV connector's scheduler side: lookups, planned loads, stores and the leases behind them."""
