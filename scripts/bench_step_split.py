"""Where a decode step's time goes, per engine (the code: bench/step_split.py)."""

from bench.step_split import main

if __name__ == "__main__":
    main()
