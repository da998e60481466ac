"""The probe set: a few fixed texts whose token logprobs prove a replica serves a version.

The learner writes `PROBE_FILE` beside each version it publishes (logprobs under the
published weights, fp32); a swap asks the replica for the same texts and compares, so
"verified serving" means these exact weights arrived (not that they are good). Both the
learner and the serving side read this record, so it lives here, in the shared core.
"""

from __future__ import annotations

from pathlib import Path

PROBE_FILE = "liverl_probe.json"
PROBE_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nprint(os.getcwd())\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    if i % 2:\n        continue\n",
    "# sort a list of numbers\nnumbers = [3, 1, 2]\n",
]


def probe_logprobs(model_dir: Path, tokenizer, forward=None) -> dict:
    """Token logprobs of the probe texts under the published weights, in fp32.

    A replica serving this version must reproduce them (same tokens, same numbers).
    `forward` (input_ids -> logits) computes with those weights already in memory (the
    learner's); without it they are loaded from `model_dir`.
    """
    import torch  # only the writers (learner, first start) pay for torch

    if forward is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        forward = lambda input_ids: model(input_ids=input_ids).logits  # noqa: E731
    probes = []
    with torch.no_grad():
        for text in PROBE_TEXTS:
            ids = tokenizer(text)["input_ids"]
            logits = forward(torch.tensor([ids])).float()
            logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])
            probes.append({"token_ids": ids, "logprobs": logp.squeeze(-1).tolist()})
    return {"probes": probes}
