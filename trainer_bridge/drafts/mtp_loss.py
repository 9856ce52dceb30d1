"""The MTP layers' online training loss (--enable-mtp-training)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer_bridge.micro_batches.layout import MicroBatch


def mtp_loss(gpt: Any, vocab_size: int, batch: MicroBatch, hidden: Tensor, mask: Tensor) -> Tensor:
    """Cross-entropy of MTP layer 1 predicting token t + 2 at position t, on a detached trunk:
    the embedding it reads, the hidden states it extends and the output head are constants.
    `hidden`: the trunk's output in `batch`'s layout; `mask` [b, S - 1]: the scored positions in
    the padded layout (position t scores token t + 1). Packed, megatron's MTP block rolls the
    tokens within each sequence (cu_seqlens), so no sequence predicts from the next one."""
    packed = batch.packed_seq_params

    def embed(input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return gpt.embedding(input_ids=input_ids, position_ids=position_ids).detach()

    # MLA rotates its queries and keys itself (GPTModel builds no rotary module and passes None).
    rotary = (
        None
        if gpt.config.multi_latent_attention
        else gpt.rotary_pos_emb(batch.rotary_seq_len, packed_seq=packed is not None)
    )
    out = gpt.mtp(
        input_ids=batch.tokens,
        position_ids=batch.position_ids,
        hidden_states=hidden.detach(),
        attention_mask=None,
        rotary_pos_emb=rotary,
        packed_seq_params=packed,
        embedding=embed,
    )
    mtp_hidden = torch.chunk(out, 1 + gpt.config.mtp_num_layers, dim=0)[1]
    weight = (
        gpt.shared_embedding_or_output_weight()
        if gpt.share_embeddings_and_output_weights
        else gpt.output_layer.weight
    ).detach()
    logits, _ = gpt.output_layer(mtp_hidden, weight=weight, runtime_gather_output=True)
    logits = logits.transpose(0, 1)[:, :-2, :vocab_size].float()
    target = batch.tokens[:, 2:]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
    ).view_as(target)
    ce = batch.unpack(ce, 2)  # [b, S - 2]: position t predicting token t + 2
    m = mask[:, 1:].float()  # position t + 1 predicted at t: a response token
    return (ce * m).sum() / m.sum().clamp(min=1)
