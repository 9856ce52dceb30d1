"""The GPU runbook's results as one Markdown page (the code: bench/gpu_summary.py)."""

from bench.gpu_summary import main

if __name__ == "__main__":
    main()
