"""The hidden-state side: `reader.HiddenStatesReader` reads a request's captured hidden states
back from the tiers (what training jobs and the connector use), and `export` writes them out as
safetensors files.

The reader may import `kvtier.core`, the arena's file layout in `kvtier.tiers` and the clients;
`export` also builds a tier manager (`kvtier.tiering`) to read a node's tiers without kvtierd.
"""
