"""Layers every model imports: RMSNorm, rotary embeddings, the attention core and its masks,
SwiGLU, order-independent initialisation. A model folder holds only what is its own."""
