"""The GPU runbook: packing for a machine without internet, the steps, their summary."""
