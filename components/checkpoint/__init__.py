"""Checkpoints: the DCP checkpointer, the model's state in any layout, and what a failed save says."""
