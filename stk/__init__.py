"""stk: fine-tune diffusion models across a Slurm cluster."""
