"""Speculative decoding: one worker per algorithm behind ModelWorker's interface, and the
speculation policy the scheduler asks how to decode.

EAGLE / EAGLE3 / STANDALONE and MTP (EAGLE with no draft path on a target with MTP layers) draft
with a model (eagle_worker.py); NGRAM drafts from an n-gram cache (ngram.py). All verify with
the same tree rejection sampling (verify.py) and KV bookkeeping (base.py). policy.py decides
which requests speculate and how deep, with the acceptance alarm (accept_alarm.py) and the
--speculative-adaptive cost model (adaptive/) as its parts; factory.py builds a worker and its
policy.
"""
