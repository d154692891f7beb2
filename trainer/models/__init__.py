"""Reference models: a GPT-2 style decoder and a small CNN."""
