"""What operators watch: the metric specs (`metric_specs`), the per-call telemetry kvtierd keeps
(`telemetry`), the Prometheus collector over a tier manager (`metrics`) and the `kvtier top`
console (`top`).

It may import `kvtier.core`, `kvtier.tiers` and `kvtier.tiering`; only the daemon and the CLI
import it.
"""
