"""`sluice tune`: search a model's batching and instance configuration against a running server.

`space` says what may change and in which order, `search` walks it (coordinate descent, hill
climbing along each ordered axis, then re-measuring the best few beside the original), `server`
reloads candidates through Triton's repository API and restores the original, `trial` measures
one candidate with the load harness, and `report` writes the winner and the report folder.
"""
