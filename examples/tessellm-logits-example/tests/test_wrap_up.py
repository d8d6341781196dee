"""`wrap-up` passes tessellm's logits conformance suite, on requests with different arguments."""

from tessellm.testing.conformance import LogitsConformance


class TestWrapUp(LogitsConformance):
    plugin = "wrap-up"
    requests = [{"logits_processors": [{"name": "wrap-up", "args": {"after": 4, "boost": 2.5}}]},
                {"logits_processors": [{"name": "wrap-up", "args": {"after": 0, "boost": 1000.0}}]},
                {"logits_processors": ["wrap-up"]}]
