"""A replica's OpenAI server: vLLM's own, whose streamed answers also carry routed experts.

vLLM puts a completion's routed experts (``routed_experts``: base64 of a ``.npy``
``[prompt + completion - 1 tokens, MoE layers, top_k]``) on its terminal output and
returns them in a whole answer, but its two stream generators drop them: a streamed
completion would reach the learner without the routing the replica used, and the learner
would recompute it (issue 45). This entry point wraps both generators so that, before
``data: [DONE]``, one more chunk carries each finished choice's routing:

    data: {"object": "text_completion", "choices": [{"index": 0, "text": "", "routed_experts": "..."}]}

(``chat.completion.chunk`` with an empty ``delta`` for chat). The gateway records it and
passes it on only to a client that asked for routing. Runs in the replica's API-server
process, from the serving environment, on CPU and GPU alike: it imports vLLM alone.

    python -m serving.replica_server --model ... (vLLM's api_server arguments)
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

DONE = "data: [DONE]\n\n"


def routing_chunk(routing: dict[int, str], chat: bool) -> str:
    """The chunk that carries each choice's routing, in the stream's own shape."""
    filler: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
    return "data: " + json.dumps({
        "object": "chat.completion.chunk" if chat else "text_completion",
        "choices": [{"index": index, **filler, "routed_experts": experts}
                    for index, experts in sorted(routing.items())],
    }) + "\n\n"


def with_routing(stream: Callable[..., AsyncIterator[str]], chat: bool) -> Callable[..., AsyncIterator[str]]:
    """`stream` (one of vLLM's stream generators), watching the engine outputs it reads for
    their routed experts and sending them in one chunk before its end."""
    from vllm.utils.serial_utils import numpy2base64

    signature = inspect.signature(stream)

    @functools.wraps(stream)
    async def streaming(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        request, outputs = bound.arguments["request"], bound.arguments["result_generator"]
        choices_per_prompt = request.n or 1
        routing: dict[int, str] = {}

        async def watched() -> AsyncIterator[Any]:
            async for item in outputs:  # completions: (prompt index, output); chat: output
                prompt, result = item if isinstance(item, tuple) else (0, item)
                for output in result.outputs:
                    if output.routed_experts is not None:  # on a choice's terminal output only
                        index = output.index + prompt * choices_per_prompt  # the index its chunks carry
                        routing[index] = numpy2base64(output.routed_experts)
                yield item

        bound.arguments["result_generator"] = watched()
        async for line in stream(*bound.args, **bound.kwargs):
            if line == DONE and routing:
                yield routing_chunk(routing, chat)
            yield line

    return streaming


def install() -> None:
    """Wrap vLLM's completion and chat stream generators (idempotent)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    for cls, name, chat in ((OpenAIServingCompletion, "completion_stream_generator", False),
                            (OpenAIServingChat, "chat_completion_stream_generator", True)):
        method = getattr(cls, name)
        if not getattr(method, "liverl_routing", False):
            wrapped = with_routing(method, chat)
            wrapped.liverl_routing = True  # type: ignore[attr-defined]
            setattr(cls, name, wrapped)


if __name__ == "__main__":
    install()
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
