"""Plan and execute: which output tensors exist, where each comes from, how experts are placed."""
