"""tessellm-logits-example: the logits processor 'wrap-up'."""
