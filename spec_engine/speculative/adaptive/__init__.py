"""--speculative-adaptive's cost model: whether each decode step speculates, and how deep.

model.py chooses (SpecCostModel), costs.py keeps what steps cost per batch-size bucket,
accept_lengths.py how far drafts are accepted per depth.
"""
