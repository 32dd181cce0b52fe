"""What the benchmarks share: kvtierd in a subprocess (`kvtierd`), the connector's engine
configuration (`connector`), namespaces (`specs`), byte units and sizes (`sizes`), buffers and
timing (`buffers`), statistics (`stats`), targets (`targets`), the machine's page cache and CPU
time (`system`) and the engine benchmarks' timed cases (`cases`). Locally built models, vLLM's
server and S3 on moto are the tests' as well, in `tests.fixtures`."""
