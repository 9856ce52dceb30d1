"""The drafts the trainer trains online beside the policy: the model's own MTP layers (which of
them learn and at what rate: mtp_training.py; their loss: mtp_loss.py) and, with
--enable-draft-training, the engines' external draft (online.py), an EAGLE-2 (eagle2.py), EAGLE-3
(eagle3.py) or STANDALONE (standalone.py) one; layers.py holds what EAGLE-2 and EAGLE-3 share."""
