"""A stage's state: its whole state as one byte buffer (the codec), and per-stage checkpoints."""
