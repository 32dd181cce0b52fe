"""The draft model's pool through weight swaps: its revision, fills and acceptance."""
