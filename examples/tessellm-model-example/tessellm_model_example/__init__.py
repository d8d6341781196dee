"""Toyformer: a decoder whose layers add attention and a gated MLP, both read from one norm
of the residual, in parallel (GPT-J's layout), with rotary embeddings and grouped-query
attention. ``reference`` is its transformers implementation (registered with transformers'
Auto classes, so ``AutoModelForCausalLM`` loads its checkpoints); ``model`` is the tessellm
model plugin that serves them."""
