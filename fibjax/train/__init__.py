"""Training: optimizer, sharding, checkpointing, the step and the loop."""
