"""Model specs: geometry and byte sizes of MoE models, from checkpoints, GGUF headers or the catalogue."""
