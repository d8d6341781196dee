"""The built-in logits processors: per-request penalties, bans, a bias and allowed tokens."""
