"""The shared vocabulary every other layer speaks: chunk keys and namespaces (`keys`), the
verified chunk format (`blockfmt`), the data-plane protocol and its records (`protocol`,
`journal`), pool registrations (`pools`), the one typed configuration tree (`config`), domain
errors and their gRPC codes (`errors`, `status`), the protobuf conversions (`codec`, `wire`) and
small process-wide helpers (`counters`, `memory`, `cpus`, `priority`).

It may import only itself and the generated stubs in `kvtier.api`; everything else in kvtier
imports it.
"""
