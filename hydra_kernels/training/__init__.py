"""Head training, evaluation data and (later) tree search."""
from .data import mtbench_questions
from .heads import head_training_pairs, train_drafter

__all__ = ["mtbench_questions", "train_drafter", "head_training_pairs"]
