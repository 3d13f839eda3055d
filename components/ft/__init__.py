"""Fault tolerance on torchft: the checks of a run's settings, replica groups per step, and DiLoCo."""
