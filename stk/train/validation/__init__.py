"""Sample images: which and when (plan), the loop's validator, the rendering on every rank, and the prompts'
embeddings."""
