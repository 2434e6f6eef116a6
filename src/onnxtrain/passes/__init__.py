"""Graph passes and the named pipelines that run them."""
