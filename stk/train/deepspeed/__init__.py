"""DeepSpeed: the config and its presets, the engine around the denoiser, the optimizer and schedule it steps, its op
builds, and the process group's rendezvous."""
