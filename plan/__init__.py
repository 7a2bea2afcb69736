"""Plans of a training run made before its first step: memory.py, the training-memory plan."""
