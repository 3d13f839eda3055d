"""What every decoder family shares: RMSNorm, rotary embeddings, grouped-query attention (around
weft.layers' attention core), SwiGLU, the decoder frame with its initialisation and pipeline-stage
forward, the dense TP plan and pipeline units, the Hugging Face name table and config.json helpers,
FLOPs and parameter counts, and `decoder_spec`. A family folder holds only what is its own, and
never imports another family's folder."""
