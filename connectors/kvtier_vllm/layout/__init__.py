"""The pools the KV connector stores and what their chunks look like: which registered layers
form the target, draft and hidden pools, and how a chunk keeps pages in fp8. The KV connector's
sides, the draft pool and hidden-state capture all read it; it imports none of them."""
