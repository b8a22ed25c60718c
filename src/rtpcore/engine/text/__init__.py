"""Per request, in the caller's thread: tokenizer, chat template, prompts -> token ids; engine_core's outputs -> detokenized text with stop strings. Above worker/."""
