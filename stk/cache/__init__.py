"""stk-cache: distributed precompute of VAE latents and text embeddings into HDF5 shards."""
