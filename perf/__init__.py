"""Performance without an accelerator: the training step counted and estimated under fake
tensors (step.py, docs/performance.md), and the one place the project's own Triton kernels are
launched, or recorded when counted (launch.py)."""
