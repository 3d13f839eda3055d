"""Models built by transformers' own modeling code from a Hugging Face folder's config.json: the
backend for the families weft does not implement (spec.py: TRANSFORMERS_SPEC)."""
