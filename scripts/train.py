"""The RL loop's command (the loop itself: specrl.loop, slime's train.py).

    python -m scripts.train --hf-checkpoint M --prompt-data D.jsonl --rollout-batch-size 8 \\
        --n-samples-per-prompt 4 --rm-type tiny --num-rollout 10 --output-dir runs/x \\
        --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2

`--help` lists every flag (specrl.train_options); `--dry-run` checks them and stops.
"""

from specrl.loop import main

if __name__ == "__main__":
    main()
