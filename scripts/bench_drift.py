"""Frozen vs online-trained draft on the tiny drift task (the code: bench/drift.py)."""

from bench.drift import main

if __name__ == "__main__":
    main()
