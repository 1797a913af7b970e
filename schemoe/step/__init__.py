"""What composes layers into a training step: the scheduled block stack with micro-chunks
(stack.py, runtime.py) and the scheduled dense-gradient synchronisation (gradsync.py)."""
