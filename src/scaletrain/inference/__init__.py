"""Asking a trained model something and measuring it: `scaletrain generate` and `scaletrain eval`.

- source.py: what a PATH holds (a run, one checkpoint, a Hugging Face model folder), its weights read into one
  process with DCP, and the tokenizer it was trained with;
- text.py: prompts and chat turns to token ids and back (the tokenizer's own chat template, or bytes);
- generate.py: transformers' `generate` (KV cache, greedy or sampled) on the model built in memory;
- evaluate.py: loss and perplexity over the trained tokens of a prepared dataset's split.
"""
