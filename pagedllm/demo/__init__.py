"""The built-in demo model and the tiny-model builder the tests use (random weights, a BPE
tokenizer trained on a generated corpus, saved in the Hugging Face layout). Nothing in the
engine, the layers or the models imports this package: only the entrypoints (for the default
model) and the tests do."""
