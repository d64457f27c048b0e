"""What is trained and how it is held: every weight or an adapter (kinds, lora), the frozen base's precision, the
weights loaded once, flat per block, fp8 matmuls, compiled blocks, the EMA, and the final pipeline written."""
