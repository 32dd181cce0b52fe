"""The `kvtier` command: `main` wires the subcommands (serve, config, the admin verbs, `top`,
`bench`), and `hidden` the hidden-state export. It sits on top and may import every layer; no
layer imports it.
"""
