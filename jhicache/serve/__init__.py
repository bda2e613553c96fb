"""jhicache.serve: an HTTP server over AsyncEngine speaking OpenAI's and SGLang's APIs, with the
checkpoint's tokenizer and Prometheus metrics. Start it with `python -m jhicache.serve`."""
