"""What a run reports: the log and its setup, metrics, per-rank times, time left, wandb and the profiler."""
