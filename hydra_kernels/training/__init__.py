"""Drafter training (heads, EAGLE, MLPSpeculator, Amphista), evaluation data and tree search."""
from .amphista import train_amphista
from .data import (mtbench_questions, recipe_draft_vocabulary, self_data_sequences, sharegpt_records,
                   sharegpt_token_sequences)
from .heads import head_inputs, train_drafter
from .hidden_cache import HiddenStates, compute_hidden_states, draft_vocabulary
from .mlp_speculator import train_mlp_speculator

__all__ = ["mtbench_questions", "sharegpt_records", "sharegpt_token_sequences", "self_data_sequences",
           "recipe_draft_vocabulary", "train_drafter", "train_mlp_speculator", "train_amphista", "head_inputs",
           "HiddenStates", "compute_hidden_states", "draft_vocabulary"]
