"""The asynchronous RL loop's command (slime's train_async.py; the loop: specrl.async_loop).

    python -m scripts.train_async --hf-checkpoint M --prompt-data D.jsonl --rollout-batch-size 8 \\
        --n-samples-per-prompt 4 --rm-type tiny --num-rollout 10 --output-dir runs/x

scripts/train.py's flags; rollout N+1 is generated while the trainer trains on N, the weights
pushed every --update-weights-interval steps; --colocate is refused (run scripts/train.py).
"""

from specrl.async_loop import main

if __name__ == "__main__":
    main()
