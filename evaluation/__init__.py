"""Evaluation of a trained model: perplexity, loss by position, passkey retrieval (`burst eval`)."""

from evaluation.checkpoint import EvalCheckpoint, check_tokenizer, load_for_eval
from evaluation.passkey import PasskeyCell, PasskeyResult, evaluate_passkey, greedy_answer
from evaluation.perplexity import PerplexityResult, PositionBucket, evaluate_perplexity
from evaluation.result import EvalResult
from evaluation.run import EvalConfig, evaluate

__all__ = [
    "EvalCheckpoint",
    "EvalConfig",
    "EvalResult",
    "PasskeyCell",
    "PasskeyResult",
    "PerplexityResult",
    "PositionBucket",
    "check_tokenizer",
    "evaluate",
    "evaluate_passkey",
    "evaluate_perplexity",
    "greedy_answer",
    "load_for_eval",
]
