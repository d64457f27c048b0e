"""Images: the formats stk reads, their headers read from the first bytes, header-only size and orientation, and the
decode, resize and crop for the VAE."""
