"""Speculative decoding: one worker per algorithm behind ModelWorker's interface.

EAGLE / EAGLE3 / STANDALONE and MTP (EAGLE with no draft path on a target with MTP layers) draft
with a model (eagle_worker.py); NGRAM drafts from an n-gram cache (ngram.py). All verify with
the same tree rejection sampling (verify.py) and KV bookkeeping (base.py); factory.py picks one.
"""
