"""Performance estimates that need no accelerator (docs/performance.md)."""
