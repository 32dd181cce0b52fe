"""The encoder-cache connector: multimodal encoder outputs stored and loaded through kvtier's
tiers."""
