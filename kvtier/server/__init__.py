"""kvtierd: the daemon wiring, its gRPC servicers, sessions and authentication."""
