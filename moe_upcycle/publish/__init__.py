"""What is published beside the tensors: config.json, tokenizer files, model card, manifest."""
