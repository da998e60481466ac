"""Names and constants of the coding environment's train and held-out splits.

The environment draws its tasks from them (`rollouts/coding.py`), and the starter's primer
(`policies/primer.py`) stays clear of them, so no task of either split is in mid-training.
Disjoint, so no held-out task is a training task with a new seed.
"""

NAMES = {
    "train": ["convert", "handle", "process", "compute", "transform", "apply", "prepare", "resolve",
              "update", "build", "render", "measure"],
    "heldout": ["evaluate", "derive", "produce", "adjust", "shape", "finish", "digest", "settle",
                "refine", "gather"],
}
PARAMS = {
    "train": ["value", "name", "path", "key", "line", "data", "result", "item", "text", "args", "node",
              "size"],
    "heldout": ["obj", "count", "word", "entry", "source", "mode", "token", "buf", "field", "part"],
}
CONSTANTS = {"train": [2, 3, 5, 7, 10, 12], "heldout": [4, 6, 8, 9, 11]}
