"""Data preparation: tokenize text into megatron-core indexed datasets
(``python -m tools.data.preprocess_data``) and train a small byte-level BPE tokenizer
(``python -m tools.data.train_tokenizer``). The dataset writer is
``megatron.training.preprocess``, the readers ``megatron.training.data``."""
