"""Plans of a training run made before its first step: checks.py, what train.py refuses (each in
one line); memory.py, the training-memory plan."""
