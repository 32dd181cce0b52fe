"""kvtierd: the daemon wiring, its gRPC servicers, sessions and authentication, and its HTTP port
(metrics, probes)."""
