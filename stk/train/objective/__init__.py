"""The training loss of each kind of family, as diffusers' examples write it (objectives), and the loss options people
tune (losses)."""
