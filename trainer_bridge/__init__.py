"""trainer_bridge: the megatron-core side of specrl (policy training, weight push into engines).

By job:
    actor/              one trainer rank (TrainActor: its build, forward and log-probs, train
                        steps) and the ranks of one group as Ray actors (TrainGroup)
    options.py          TrainerArgs: the trainer's flags
    batch.py            TrainBatch: a rollout's sequences as a train step takes them
    loss.py             the policy losses (GRPO/GSPO, PPO clipping, KL, entropy, TIS)
    model/              megatron's GPTModel from a Hugging Face config (MLA, MoE, TE's names)
    micro_batches/      which sequences each micro batch holds, and their layout (padded, packed)
    parallel/           data, expert and sequence parallelism
    drafts/             the drafts trained online: MTP layers, EAGLE-2/3 and STANDALONE drafts
    routing_replay.py   the rollout's MoE routes replayed in the trainer's forward (slime's R3)
    checkpoint/         training checkpoints (megatron's dist_checkpointing) and --ref-load
    convert/            Hugging Face <-> megatron weights (python -m trainer_bridge.convert)
    weight_sync.py      the policy's weights pushed into the engines
    megatron_compat.py  megatron-core on CPU (gloo) and process-group set-up
    spec_rewrite.py     copies of megatron's layer specs with fields replaced
"""
