"""Reference models: a GPT-2 style decoder and a small CNN; and the loss wrapper of a Hugging Face
causal LM (`hf.CausalLM`)."""
