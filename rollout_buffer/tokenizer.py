"""Kept so `rollout_buffer.tokenizer.bundled_tokenizer_path` keeps working; see `generation.tokenizer`."""

from rollout_buffer.generation.tokenizer import bundled_tokenizer_path, end_of_turn_ids, load_tokenizer

__all__ = ["bundled_tokenizer_path", "end_of_turn_ids", "load_tokenizer"]
