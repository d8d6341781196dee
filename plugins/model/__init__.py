"""Built-in model architectures: each a model plugin declaring the Hugging Face model types
it builds, its spec and the blocks it takes from core/model."""
