"""The starter's primer: short documented one-line functions in the coding tasks' shape,

    def fetch(archive):
        \"\"\"Return archive unchanged.\"\"\"
        return archive

appended to the mid-training corpus, so the starter sometimes copies a parameter name after
`return` (level 1 of the coding environment) and GRPO has a signal from the start. Names
are the tokenizer's single-token lower-case words minus the coding splits' pools (and
keywords and builtins), and in a quarter of the functions names of two or three tokens
made from them, so the copy goes on past a name's first token; constants lie outside both
splits: no task of either split is in the primer, so a held-out pass is a copy, not a
memory (docs/history.md, "A starter with a primer", "Tied embeddings during
mid-training" and "A starter that copies names of several tokens").
"""

from __future__ import annotations

import builtins
import functools
import keyword
import random
import re

from transformers import PreTrainedTokenizerFast

from liverl.task_pools import CONSTANTS, NAMES, PARAMS

SPLIT_NAMES = {name for pool in (NAMES, PARAMS) for names in pool.values() for name in names}
LEVEL1 = ["Return {a} unchanged.", "Return {a} as it is.", "Return {a}.", "Give back {a}."]
MULTI_TOKEN_SHARE = 0.25  # of the functions, whose parameter is a name of several tokens
LEVEL2 = [("Return {a} plus {k}.", "{a} + {k}"), ("Return {a} times {k}.", "{a} * {k}"),
          ("Return {a} minus {k}.", "{a} - {k}")]


def name_pool(tokenizer: PreTrainedTokenizerFast) -> list[str]:
    """Lower-case words that are one token after a space, none of them a task's name."""
    banned = SPLIT_NAMES | set(keyword.kwlist) | set(dir(builtins))
    words = {tokenizer.convert_tokens_to_string([t]).strip() for t in tokenizer.get_vocab()}
    return sorted(w for w in words if re.fullmatch(r"[a-z][a-z0-9_]{1,11}", w) and w not in banned
                  and len(tokenizer(" " + w)["input_ids"]) == 1)


def multi_token_names(tokenizer: PreTrainedTokenizerFast, names: list[str], count: int = 3000) -> list[str]:
    """`count` names of two or three tokens: a primer word and a lower-case piece, or two
    primer words joined by `_`; none a split's name, a keyword or a builtin."""
    banned = SPLIT_NAMES | set(keyword.kwlist) | set(dir(builtins))
    pieces = sorted({tokenizer.convert_tokens_to_string([t]) for t in tokenizer.get_vocab()})
    pieces = [p for p in pieces if re.fullmatch(r"[a-z]{1,6}", p)]
    # A small vocabulary (the tests' starters) has few such names and draws each many times.
    tokens = functools.cache(lambda name: len(tokenizer(" " + name)["input_ids"]))
    rng, found = random.Random(1), set()
    for _ in range(100 * count):
        name = rng.choice(names) + (rng.choice(pieces) if rng.random() < 0.7 else "_" + rng.choice(names))
        if name not in banned and len(name) <= 14 and tokens(name) in (2, 3):
            found.add(name)
            if len(found) == count:
                break
    return sorted(found)


def primer(tokenizer: PreTrainedTokenizerFast, count: int, level2_share: float, seed: int = 0) -> list[str]:
    """`count` functions; a `level2_share` of them add, multiply or subtract a constant."""
    rng = random.Random(seed)
    names = name_pool(tokenizer)
    if count and not names:
        raise ValueError("the tokenizer has no single-token lower-case word to name a primer function")
    constants = [k for k in range(1, 100) if k not in CONSTANTS["train"] + CONSTANTS["heldout"]]
    functions = []
    multi = multi_token_names(tokenizer, names) if count else []
    for _ in range(count):
        function, a, k = rng.choice(names), rng.choice(names), rng.choice(constants)
        if rng.random() < MULTI_TOKEN_SHARE and multi:
            a = rng.choice(multi)
        doc, answer = rng.choice(LEVEL2) if rng.random() < level2_share else (rng.choice(LEVEL1), "{a}")
        functions.append(f'def {function}({a}):\n    """{doc.format(a=a, k=k)}"""\n'
                         f'    return {answer.format(a=a, k=k)}\n')
    return functions


def primer_tokens(tokenizer: PreTrainedTokenizerFast, count: int, level2_share: float) -> list[int]:
    """The primer's functions as one token stream, each followed by EOS."""
    ids: list[int] = []
    for text in primer(tokenizer, count, level2_share):
        ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    return ids
