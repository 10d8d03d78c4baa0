"""``prepack latents``: the training's frozen VAE encoder run on each packed canvas once, at pack time
(stage: the shards' moments; vae_encoder: the training stack's encoder; command: the subcommand)."""
