"""What one training step is made of: the loss, the optimizers, MoE load balance, and the guard against non-finite losses."""
