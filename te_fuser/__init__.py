"""te_fuser: FP8 training with fusible operations."""
