"""Model families: one file per Hugging Face ``model_type`` that reads its config.json."""
